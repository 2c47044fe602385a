"""Outputs: JSONL and CSV of every measurement and of the per-system summaries, a
markdown table, and the BLEU-vs-words/s Pareto chart."""
from __future__ import annotations

import csv
import json

from .hardware import one_line
from .scoring import pareto_frontier


def flatten(rec: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = json.dumps(v) if isinstance(v, list) else v
    return out


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_csv(path: str, records: list[dict]) -> None:
    rows = [flatten(r) for r in records]
    cols = list(dict.fromkeys(k for r in rows for k in r))  # first-seen order, all keys
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(summaries: list[dict], hardware: dict, testset: dict) -> str:
    out = [f"Test set: {testset['name']} ({testset['lines']} lines, {testset['src_words']} source words; "
           f"`{testset['origin']}`).", "", f"Machine: {one_line(hardware)}.", "",
           "| system | mode | BLEU | chrF | src words/s (median, spread) | tgt tokens/s | load s | warm-up s | "
           "latency p50/p90/p99 ms | peak RAM MB | model MB | image MB |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = sorted(summaries, key=lambda r: (r["mode"] != "throughput", -(r.get("src_words_per_s") or 0)))
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['system']} | {r['mode']} | error: {r['error']} |" + " |" * 9)
            continue
        lat = "-" if r.get("latency_ms_p50") is None else \
            f"{r['latency_ms_p50']:.1f} / {r['latency_ms_p90']:.1f} / {r['latency_ms_p99']:.1f}"
        out.append(
            f"| {r['system']} | {r['mode']} | {_f(r['bleu'], '.2f')} | {_f(r['chrf'], '.2f')} | "
            f"{r['src_words_per_s']:.1f} ±{100 * r['src_words_per_s_rel_spread']:.0f}% | "
            f"{_f(r.get('tgt_tokens_per_s'), '.1f')} | {_f(r.get('load_s'), '.2f')} | "
            f"{_f(r.get('warmup_s'), '.2f')} | {lat} | {_f(r.get('peak_ram_mb'), '.0f')} | "
            f"{_f(r.get('model_mb'), '.1f')} | {_f(r.get('image_mb'), '.0f')} |")
    sigs = sorted({(r["bleu_signature"], r["chrf_signature"]) for r in summaries if r.get("bleu_signature")})
    out += ["", "Spread: (max - min) / median of the repeats' words/s. Load time is apart from translation "
                "time; warm-up is the first pass, not counted in words/s. Peak RAM: the process's peak RSS "
                "(local systems, one process each), the container cgroup's peak (containers)."]
    for b, c in sigs:
        out += ["", f"BLEU: `{b}`", f"chrF: `{c}`"]
    return "\n".join(out) + "\n"


COLOURS = {"decoder": "tab:blue", "ct2": "tab:orange", "hf": "tab:green", "container": "tab:red"}
NAMES = {"decoder": "ours (decoder)", "ct2": "CTranslate2", "hf": "HF transformers", "container": "container"}


def plot_pareto(summaries: list[dict], path: str, title: str) -> list[dict]:
    """BLEU against source words/s (log axis), the frontier as a staircase, every point
    labelled. Returns the frontier's records."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    pts = [r for r in summaries if not r.get("error") and r.get("bleu") is not None
           and r.get("src_words_per_s")]
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    front = [pts[i] for i in pareto_frontier([(r["src_words_per_s"], r["bleu"]) for r in pts])]
    for engine in COLOURS:
        sel = [r for r in pts if r["engine"] == engine]
        if sel:
            ax.scatter([r["src_words_per_s"] for r in sel], [r["bleu"] for r in sel], s=36,
                       color=COLOURS[engine], label=NAMES[engine], zorder=3,
                       edgecolors=["black" if any(r is f for f in front) else "none" for r in sel])
    ax.set_xscale("log")
    ax.margins(x=0.25, y=0.12)  # room for the labels right of the points
    if front:
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        xs, ys = [r["src_words_per_s"] for r in front], [r["bleu"] for r in front]
        # the staircase bounds the dominated region: below and left of it, something is better
        ax.step([x0] + xs + [xs[-1]], [ys[0]] + ys + [y0], where="pre", color="0.5", ls="--", lw=1,
                label="Pareto frontier", zorder=1)
        ax.set_xlim(x0, x1)
        ax.set_ylim(y0, y1)
    label_points(ax, fig, pts)
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 400, not 4x10^2
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(plain)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("source words / second (log scale)")
    ax.set_ylabel("BLEU")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if pts:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return front


def label_points(ax, fig, pts, fontsize: int = 7) -> None:
    """Label every point, moving a label up or down when it would cover one placed before
    (systems often share a BLEU score: same weights, different engines)."""
    fig.canvas.draw()
    to_px = ax.transData.transform
    char_w, line_h = fontsize * 0.6 * fig.dpi / 72, fontsize * 1.3 * fig.dpi / 72
    marks = [to_px((r["src_words_per_s"], r["bleu"])) for r in pts]
    placed = [(x - 5, y - 5, x + 5, y + 5) for x, y in marks]  # no label over another point
    for r in sorted(pts, key=lambda r: (r["src_words_per_s"], r["bleu"])):
        x, y = to_px((r["src_words_per_s"], r["bleu"]))
        own = (x - 5, y - 5, x + 5, y + 5)
        w = char_w * len(r["system"])
        for k in range(12):
            dy = (k + 1) // 2 * (1 if k % 2 == 0 else -1) * line_h  # 0, -1, +1, -2, +2 lines
            box = (x + 4, y + 3 + dy, x + 4 + w, y + 3 + dy + line_h)
            if not any(b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3]
                       for b in placed if b != own):
                break
        placed.append(box)
        ax.annotate(r["system"], (r["src_words_per_s"], r["bleu"]), textcoords="offset pixels",
                    xytext=(4, 3 + dy), fontsize=fontsize,
                    arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5) if dy else None)
