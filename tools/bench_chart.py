"""A bench run as a picture: per group, our best row against CTranslate2's best (and
transformers' where it ran) in source words/s, with our ratio over CTranslate2 above
each pair; one panel per ISA pass. The rows are the ones the table's ratios and
summary.json name (tools/bench_groups.py: the head-to-head pair where there is one).

tools.bench draws it beside every run (PREFIX.png next to PREFIX.md/.json). This
command redraws it from the JSON a run wrote, without rerunning anything; a tools.bench_gpu
JSON draws the same chart of the GPU run, one panel:

    python -m tools.bench_chart docs/bench/cpu/kd-student-2026-11-29-avx512.json \\
        docs/bench/cpu/kd-student-2026-11-29-avx2.json --out docs/bench/cpu/kd-student-2026-11-29.png
"""
from __future__ import annotations

import json
import sys

from decoder.cliargs import ArgumentParser, HelpFormatter, add_version, path_error

from .bench_groups import GROUPS, group_best, head_to_head_rows, ratio

LABELS = {"throughput": "throughput\n(greedy, all threads)", "batch1": "batch 1\n(1 thread)",
          "beam4": "beam 4\n(all threads)"}
ENGINES = (("ours", "ours", "tab:blue"), ("ct2", "CTranslate2", "tab:orange"), ("hf", "transformers", "tab:gray"))


def bars(result: dict) -> list[dict]:
    """Per group that ran: each engine's words/s and our ratio over CTranslate2."""
    rows, out = result["rows"], []
    for g in GROUPS:
        pair = head_to_head_rows(rows, g)
        ours, ct2 = pair or (group_best(rows, g, "ours"), group_best(rows, g, "ct2"))
        hf = group_best(rows, g, "hf")
        speeds = {e: r["src_words_per_s"] for e, r in (("ours", ours), ("ct2", ct2), ("hf", hf)) if r}
        if speeds:
            out.append({"group": g, **speeds, "ratio": ratio(speeds.get("ours"), speeds.get("ct2")),
                        "h2h": pair is not None})
    return out


def from_gpu_bench(result: dict) -> dict:
    """A tools.bench_gpu JSON in tools.bench's shape: its engines ("ours fp16", "ct2 float16")
    by engine, so that a group's fastest row of each is the one its summary's ratios name (the
    ablation rows are no engine's); the machine line says the GPU and the versions that ran."""
    s = result["summary"]
    v = s.get("versions") or {}
    rows = [dict(r, engine=r["engine"].split()[0]) for r in result["rows"] if "error" not in r]
    machine = {**result["machine"], "cpu": f"{s['gpu']} (driver {v.get('driver', '-')}, CUDA {v.get('cuda', '-')})",
               "torch": v.get("torch", "-"), "ctranslate2": v.get("ctranslate2", "-")}
    return {"rows": rows, "machine": machine, "model": s.get("model", "model"), "panel": f"{s['gpu']}, fp16"}


def machine_line(result: dict) -> str:
    m = result["machine"]
    if result.get("panel"):  # a GPU run: the GPU, not the host's cores
        return f"{m['cpu']}; torch {m['torch']}, CTranslate2 {m['ctranslate2']}; {m['date'][:10]}"
    return (f"{m['cpu']}, {m['cores']} cores, {m['threads']} threads; torch {m['torch']}, "
            f"CTranslate2 {m.get('ctranslate2', '-')}; {m['date'][:10]}")


def model_line(result: dict) -> str:
    facts = result.get("model_facts") or {}
    return f"{result['model']}" + (f" ({facts['shape']})" if facts.get("shape") else "")


def plot(results: list[dict], path: str) -> str:
    """One panel per result (ISA pass); returns path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(max(5.2 * len(results), 7.2), 4.6), dpi=110, squeeze=False)
    for ax, result in zip(axes[0], results):
        groups = bars(result)
        engines = [e for e in ENGINES if any(e[0] in b for b in groups)]
        width = 0.8 / max(len(engines), 1)
        offset = {key: (i - (len(engines) - 1) / 2) * width for i, (key, _, _) in enumerate(engines)}
        for key, name, colour in engines:
            ax.bar([j + offset[key] for j, b in enumerate(groups) if key in b],
                   [b[key] for b in groups if key in b], width, label=name, color=colour)
        top = max((b.get(k, 0) for b in groups for k, _, _ in engines), default=1)
        for j, b in enumerate(groups):
            if b["ratio"] is not None:  # over the pair; from the unrounded speeds, as the tables print it
                ax.annotate(f"{b['ours'] / b['ct2']:.2f}x",
                            (j + (offset["ours"] + offset["ct2"]) / 2, max(b["ours"], b["ct2"])),
                            textcoords="offset points", xytext=(0, 3), ha="center", fontsize=9, fontweight="bold")
        ax.set_xticks(range(len(groups)), [LABELS[b["group"]] for b in groups], fontsize=8)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("source words / second")
        ax.set_title(result.get("panel") or f"ISA pass {result['machine']['isa']}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    h2h = " (head to head)" if any(b["h2h"] for r in results for b in bars(r)) else ""
    fig.suptitle(f"{model_line(results[0])}: ours / CTranslate2's best per group{h2h}\n"
                 f"{machine_line(results[0])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m tools.bench_chart", formatter_class=HelpFormatter,
                       description="Redraw a bench run's chart (ours against CTranslate2 per "
                                            "group) from the JSON tools.bench wrote.")
    add_version(p)
    p.add_argument("json", nargs="+", help="one tools.bench JSON per ISA pass, in panel order")
    p.add_argument("--out", required=True, help="PNG to write")
    a = p.parse_args(argv)
    results = []
    for f in a.json:
        try:
            with open(f, encoding="utf-8") as fh:
                r = json.load(fh)
            if isinstance(r, dict) and (r.get("summary") or {}).get("device") == "cuda" and "rows" in r:
                r = from_gpu_bench(r)
            if not isinstance(r, dict) or not {"rows", "machine", "model"} <= set(r):
                raise ValueError("no rows, machine and model: not a tools.bench JSON")
        except OSError as e:
            print(f"error: {path_error(None, f, e)}", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"error: {f}: {e}", file=sys.stderr)
            return 2
        results.append(r)
    try:
        print(plot(results, a.out))
    except (KeyError, TypeError, AttributeError) as e:
        print(f"error: {' '.join(a.json)}: not a tools.bench JSON ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
