"""Length-sorted batches under a token budget; order is restored in one place."""
from __future__ import annotations


def make_batches(lengths: list[int], max_tokens: int, max_sentences: int,
                 sort: bool = True) -> list[list[int]]:
    """Indices into `lengths`, grouped so that padded size (rows x longest) stays
    within max_tokens and rows within max_sentences. Sorting by length (longest
    first, so the biggest batch meets memory limits at once) wastes little padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort else list(range(len(lengths)))
    return pack(order, lengths, max_tokens, max_sentences)


def pack(order, lengths, max_tokens: int, max_sentences: int) -> list[list[int]]:
    """Cut `order` (indices into lengths) into consecutive batches: each grows while
    rows x longest stays within max_tokens and rows within max_sentences; an item
    over the budget alone is a batch of its own. The one packing rule of the kit:
    training and the reference searches choose only the order."""
    batches, cur, longest = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and (max(longest, n) * (len(cur) + 1) > max_tokens or len(cur) >= max_sentences):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def restore(batches: list[list[int]], results: list[list], n: int) -> list:
    """Put per-batch results back in input order."""
    out: list = [None] * n
    for idx, res in zip(batches, results):
        for i, r in zip(idx, res):
            out[i] = r
    return out
