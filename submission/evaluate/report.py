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


def unflatten(row: dict) -> dict:
    """write_csv's row back to a record: dotted keys nested, numbers and lists parsed."""
    out: dict = {}
    for k, v in row.items():
        if v == "":
            continue  # a field another row has
        *parents, leaf = k.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        if v in ("True", "False"):  # csv writes Python's bools
            d[leaf] = v == "True"
            continue
        try:
            d[leaf] = json.loads(v) if v[:1] in "[-0123456789" or v in ("true", "false") else v
        except json.JSONDecodeError:
            d[leaf] = v
    return out


def read_summaries(path: str) -> list[dict]:
    """summary.jsonl or summary.csv, as evaluate() wrote them."""
    with open(path, encoding="utf-8", newline="") as fh:
        if path.endswith(".csv"):
            return [unflatten(r) for r in csv.DictReader(fh)]
        return [_json_line(x, n) for n, x in enumerate(fh, 1) if x.strip()]


def _json_line(text: str, n: int):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {n}: invalid JSON ({e.msg})") from None


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
           f"`{testset['origin']}`).", "",
           f"Machine: {one_line(hardware)}; kernel {hardware.get('kernel')}, Python {hardware.get('python')}, "
           f"load average {hardware.get('load_avg')} at start.", "",
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


def chart_data(summaries: list[dict], hardware: dict, testset: dict, mode: str = "throughput") -> dict:
    """What the chart shows, apart from drawing it: the title (test set, language pair),
    the machine line (CPU, ISA, cores/threads, versions, date), and per point its words/s
    with the min-max of the timed passes, BLEU, model size, frontier membership and label
    (a container's WMT hardware track and CPU quota in it)."""
    pair = f"{testset['src_lang']}→{testset['tgt_lang']}" if testset.get("src_lang") and testset.get("tgt_lang") \
        else "language pair not given"
    title = f"{testset['name']} ({pair}, {testset['lines']} lines): BLEU vs source words/s" + \
        ("" if mode == "throughput" else f", {mode} mode")
    v = ", ".join(f"{k} {x}" for k, x in hardware.get("versions", {}).items() if x and k in ("torch", "ctranslate2"))
    machine = (f"{hardware['cpu']} ({hardware.get('isa') or ' '.join(hardware['flags'])}), {hardware['cores']} cores / "
               f"{hardware.get('threads', hardware['cores'])} threads; {v}; {hardware.get('date', '')}").rstrip("; ")
    rows = [r for r in summaries if not r.get("error") and r.get("bleu") is not None and r.get("src_words_per_s")]
    front = set(pareto_frontier([(r["src_words_per_s"], r["bleu"]) for r in rows]))
    points = []
    for i, r in enumerate(rows):
        label = r["system"]
        if r["engine"] == "container":
            c = r.get("config", {})
            label = f"container {c.get('hardware')}, {c.get('cpus', 0):g} CPU ({r.get('name', '')})"
        x = r["src_words_per_s"]
        points.append({"system": r["system"], "label": label, "engine": r["engine"], "x": x,
                       "x_min": r.get("src_words_per_s_min", x), "x_max": r.get("src_words_per_s_max", x),
                       "repeats": r.get("repeats"), "bleu": r["bleu"], "model_mb": r.get("model_mb"),
                       "peak_ram_mb": r.get("peak_ram_mb"), "on_frontier": i in front, "record": r})
    return {"title": title, "machine": machine, "points": points}


def marker_area(mb: float | None, largest: float) -> float:
    """Marker area in pt^2 proportional to model size on disk (15..250)."""
    return 15.0 if not mb or not largest else 15.0 + 235.0 * mb / largest


def plot_pareto(data: dict, path: str) -> None:
    """BLEU against source words/s (log axis) with the passes' min-max as whiskers, the
    frontier as a staircase, marker area by model size, every point labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    pts = data["points"]
    largest = max((p["model_mb"] or 0 for p in pts), default=0)
    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=120)
    for engine in COLOURS:
        sel = [p for p in pts if p["engine"] == engine]
        if not sel:
            continue
        xs, ys = [p["x"] for p in sel], [p["bleu"] for p in sel]
        ax.errorbar(xs, ys, xerr=[[p["x"] - p["x_min"] for p in sel], [p["x_max"] - p["x"] for p in sel]],
                    fmt="none", ecolor=COLOURS[engine], elinewidth=1, capsize=3, alpha=0.7, zorder=2)
        ax.scatter(xs, ys, s=[marker_area(p["model_mb"], largest) for p in sel], color=COLOURS[engine],
                   zorder=3, edgecolors=["black" if p["on_frontier"] else "none" for p in sel])
        ax.scatter([], [], s=36, color=COLOURS[engine], label=NAMES[engine])  # legend: colour, not size
    ax.set_xscale("log")
    ax.margins(x=0.25, y=0.12)  # room for the labels right of the points
    front = sorted((p for p in pts if p["on_frontier"]), key=lambda p: p["x"])
    if front:
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        xs, ys = [p["x"] for p in front], [p["bleu"] for p in front]
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
    ax.set_xlabel("source words / second (log scale; whiskers: min-max of the timed passes)")
    ax.set_ylabel("BLEU")
    ax.set_title(f"{data['title']}\n{data['machine']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if pts:
        if largest:  # two reference sizes, so an area can be read
            for mb in sorted({round(largest, 1), round(largest / 4, 1)}):
                ax.scatter([], [], s=marker_area(mb, largest), color="0.7", label=f"model {mb:g} MB")
        ax.legend(fontsize=7, loc="best", labelspacing=1.2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def label_points(ax, fig, pts, fontsize: int = 7) -> None:
    """Label every point, moving a label up or down when it would cover one placed before
    (systems often share a BLEU score: same weights, different engines)."""
    fig.canvas.draw()
    to_px = ax.transData.transform
    char_w, line_h = fontsize * 0.6 * fig.dpi / 72, fontsize * 1.3 * fig.dpi / 72
    marks = [to_px((r["x"], r["bleu"])) for r in pts]
    placed = [(x - 5, y - 5, x + 5, y + 5) for x, y in marks]  # no label over another point
    for r in sorted(pts, key=lambda r: (r["x"], r["bleu"])):
        x, y = to_px((r["x"], r["bleu"]))
        own = (x - 5, y - 5, x + 5, y + 5)
        w = char_w * len(r["label"])
        for k in range(12):
            dy = (k + 1) // 2 * (1 if k % 2 == 0 else -1) * line_h  # 0, -1, +1, -2, +2 lines
            box = (x + 4, y + 3 + dy, x + 4 + w, y + 3 + dy + line_h)
            if not any(b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3]
                       for b in placed if b != own):
                break
        placed.append(box)
        ax.annotate(r["label"], (r["x"], r["bleu"]), textcoords="offset pixels",
                    xytext=(4, 3 + dy), fontsize=fontsize,
                    arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5) if dy else None)
