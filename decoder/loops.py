"""Which search loop runs a batch, decided once per plan (as sockeye's `get_beam_search`):
decoder/search.py's per-step and device-style loops, decoder/static_steps.py's
fixed-address ones. A loop takes (search, state, limits (B,) on the device, the same
limits as Python ints, the shortlist's ids or None) and gives the batch's `Outputs`."""
from __future__ import annotations

from typing import Callable

from .optimisations import Plan
from .search import Outputs, beam_device, beam_search, greedy, greedy_device, greedy_one
from .static_steps import beam_static, greedy_static

Loop = Callable[..., Outputs]


def loop_of(plan: Plan) -> Loop:
    """The plan's loop: the fixed-address steps where graph_steps resolved; else beam or greedy,
    reading the finished rows every step (sync_every 1) or device-style; a greedy batch of one
    sentence takes the one-row loop where the plan has that state."""
    if plan.graph_steps:
        static = beam_static if plan.loop == "beam" else greedy_static
        return lambda s, state, limits, lims, vocab=None: static(state, limits, s, lims)
    if plan.loop == "beam":
        beam = beam_search if plan.sync_every == 1 else beam_device
        return lambda s, state, limits, lims, vocab=None: Outputs.of(beam(state, limits, s, vocab, lims))
    batch = greedy if plan.sync_every == 1 else greedy_device

    def greedy_loop(s, state, limits, lims: list[int], vocab=None) -> Outputs:
        if plan.state_for(len(lims)) == "one_row":
            return Outputs.of([greedy_one(state, lims[0], s, vocab)])
        return Outputs.of(batch(state, limits, s, vocab, lims))
    return greedy_loop
