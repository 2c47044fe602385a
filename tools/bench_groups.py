"""The bench's three groups, and which row of a group stands for an engine: the
fastest, ours only within 0.2 BLEU of our best fp32 row, the head-to-head pair
where the group has one. tools.bench takes its ratios from here, tools.bench_chart
its bars, so the table, summary.json and the chart always name the same rows."""
from __future__ import annotations

GROUPS = ("throughput", "batch1", "beam4")
SUMMARY_RATIOS = {"throughput": "throughput_vs_ct2_best", "batch1": "batch1_vs_ct2", "beam4": "beam4_vs_ct2"}


def ratio(x, y):
    return round(x / y, 3) if x and y else None


def group_best(rows: list[dict], group: str, engine: str, max_bleu_loss: float = 0.2) -> dict | None:
    """The fastest row (source words/s) of an engine in a group; ours within `max_bleu_loss`
    BLEU of our best fp32 row of that group, where one has a BLEU. Head-to-head rows
    (`h2h`, the best two timed again side by side) are not candidates."""
    rs = [r for r in rows if r.get("group") == group and r["engine"] == engine and not r.get("h2h")]
    ref = [r["bleu"] for r in rs if r.get("precision") == "fp32" and r.get("bleu") is not None]
    if engine == "ours" and ref:
        rs = [r for r in rs if r.get("bleu") is None or r["bleu"] >= max(ref) - max_bleu_loss]
    return max(rs, key=lambda r: r["src_words_per_s"], default=None)


def group_ratios(rows: list[dict], h2h: bool = True) -> dict[str, float | None]:
    """{group: our best words/s / CT2's best words/s}, same run: from the group's head-to-head
    rows where it has them (h2h), else from the best rows as each was timed."""
    out = {}
    for g in GROUPS:
        ours, ct2 = group_best(rows, g, "ours"), group_best(rows, g, "ct2")
        pair = head_to_head_rows(rows, g) if h2h else None
        if pair:
            ours, ct2 = pair
        out[g] = ratio(ours and ours["src_words_per_s"], ct2 and ct2["src_words_per_s"])
    return out


def head_to_head_rows(rows: list[dict], group: str) -> tuple[dict, dict] | None:
    """(ours, CT2's) head-to-head rows of a group, if it was timed so."""
    pair = {r["engine"]: r for r in rows if r.get("group") == group and r.get("h2h")}
    return (pair["ours"], pair["ct2"]) if {"ours", "ct2"} <= set(pair) else None
