"""Dev-BLEU curves as a PNG, from the history training already records (metrics.json).

    plot_dev_bleu({"teacher": ([300, 600], [0.8, 5.1]), "student": ([200, 400], [1.2, 4.0])},
                  "runs/x/dev-bleu.png", title="bible-en-es, default preset")

student.train draws its one run's curve into its run dir; student.distill draws the
teacher's (when it is one of ours) and the students' into the run dir, beside report.md.
Redraw from what a run recorded (a distill report.json, or metrics.json files):

    python -m student.chart runs/default/report.json --out dev-bleu.png
"""
from __future__ import annotations

import json
import os
import sys

CHART = "dev-bleu.png"


def curves_of(metrics: dict) -> tuple[list[int], list[float]]:
    """(steps, dev BLEU) of a metrics.json; the evaluations that had no BLEU are left out."""
    pts = [(h["step"], h["dev_bleu"]) for h in metrics.get("history", []) if h.get("dev_bleu") is not None]
    return [s for s, _ in pts], [b for _, b in pts]


def plot_dev_bleu(curves: dict[str, tuple[list[int], list[float]]], path: str, title: str = "") -> str | None:
    """One line per run (dev BLEU against training step), its best point marked and
    labelled; returns path, or None (and writes nothing) when no run has a point."""
    curves = {k: v for k, v in curves.items() if v[0]}
    if not curves:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, (steps, bleu) in curves.items():
        line, = ax.plot(steps, bleu, marker="o", ms=3, lw=1.5, label=name)
        i = max(range(len(bleu)), key=bleu.__getitem__)
        ax.annotate(f"{bleu[i]:.1f}", (steps[i], bleu[i]), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=8, color=line.get_color())
    ax.margins(y=0.12)  # room for the best points' labels
    ax.set_xlabel("training step")
    ax.set_ylabel("dev BLEU (greedy)")
    ax.set_title(title or "dev BLEU during training", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def curves_in(path: str) -> dict[str, tuple[list[int], list[float]]]:
    """The curves of a distill report.json (its `training`) or of one metrics.json
    (named by its run dir)."""
    with open(path, encoding="utf-8") as fh:
        d = json.load(fh)
    if isinstance(d, dict) and isinstance(d.get("training"), dict):
        return {n: (t["dev_steps"], t["dev_bleu"]) for n, t in d["training"].items()}
    if isinstance(d, dict) and isinstance(d.get("history"), list):
        return {os.path.basename(os.path.dirname(os.path.abspath(path))): curves_of(d)}
    raise ValueError("neither a distill report.json (training) nor a metrics.json (history)")


def main(argv=None) -> int:
    from decoder.cliargs import ArgumentParser, HelpFormatter, add_version, path_error
    p = ArgumentParser(prog="python -m student.chart", formatter_class=HelpFormatter,
                       description="Draw dev-BLEU curves from a distill report.json or "
                                            "student.train metrics.json files.")
    add_version(p)
    p.add_argument("json", nargs="+", help="report.json of student.distill, or metrics.json of student.train")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="", help="chart title")
    a = p.parse_args(argv)
    curves = {}
    for f in a.json:
        try:
            curves.update(curves_in(f))
        except OSError as e:
            print(f"error: {path_error(None, f, e)}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError) as e:
            print(f"error: {f}: {e}", file=sys.stderr)
            return 2
    out = plot_dev_bleu(curves, a.out, a.title)
    if out is None:
        print(f"error: {' '.join(a.json)}: no dev evaluation to draw", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
