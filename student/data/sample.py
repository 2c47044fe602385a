"""A uniform random sample of a stream under a count and a byte bound (SentencePiece's input).

Each item draws a random key; the sample is the items of smallest key that fit
both bounds (bottom-k sampling). An item whose key is above the largest kept
one is skipped without a look, so the sample is always a prefix of the key
order and the memory is the bound, whatever the stream's length. A stream that
fits whole is kept whole, in its order.
"""
from __future__ import annotations

import heapq
import math

import numpy as np


class Sample:
    def __init__(self, max_items: int, max_bytes: int, seed: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.rng = np.random.default_rng([seed, 0x5A])  # its own stream: the split's draws stay as they are
        self.heap: list = []  # (-key, position, item, nbytes): the largest key on top
        self.bytes, self.seen, self.threshold = 0, 0, math.inf

    def add(self, items: list, sizes: list[int]) -> None:
        """A chunk of the stream, with each item's size in bytes."""
        keys = self.rng.random(len(items))
        for j in np.flatnonzero(keys < self.threshold).tolist():
            heapq.heappush(self.heap, (-keys[j], self.seen + j, items[j], sizes[j]))
            self.bytes += sizes[j]
            while len(self.heap) > self.max_items or self.bytes > self.max_bytes:
                key, _, _, n = heapq.heappop(self.heap)
                self.bytes -= n
                self.threshold = -key  # everything kept has a smaller key than the one dropped
            if self.threshold < math.inf and self.heap:
                self.threshold = -self.heap[0][0]
        self.seen += len(items)

    def items(self) -> list:
        """The sample in stream order."""
        return [item for _, _, item, _ in sorted(self.heap, key=lambda e: e[1])]

    def __len__(self):
        return len(self.heap)
