"""decoder/refill_device.py: the finished rows take the ring's next sentences on the device, each
step. On CPU the fixed-shape state runs eagerly (static_shapes), the same ops a GPU captures:
the tokens, the steps, the host reads, the ring and the per-step cap."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_refill import MODEL, SMALL, STAGED, counted_blocks, source_lines, trained

from decoder import Translator, hostsync, refill_device
from decoder.optimisations import Kernels, Switches, resolve


@trained
@pytest.mark.parametrize("kw", [dict(sync_every=1), dict(sync_every=3), dict(sync_every=8),
                                dict(sync_every=4, max_len_a=0.0, max_len_b=1),  # each sentence one forced </s>
                                dict(sync_every=4, graph_attention=True),
                                dict(sync_every=5, sort=False)])
def test_rows_refilled_on_the_device_give_the_per_batch_tokens_in_input_order(kw):
    lines = source_lines(150)
    lines[3] = lines[77] = ""  # empty lines stay empty and hold their place
    tr = Translator(MODEL, static_shapes=True, refill_on_device=True, **SMALL, **kw)
    assert tr.plan.refill_on_device
    assert tr.translate(lines) == Translator(MODEL, static_shapes=True, refill_rows=False, **SMALL,
                                             **kw).translate(lines)


@trained
@pytest.mark.parametrize("ring_share, per_step_share", [(64, 1), (1, 64), (64, 64), (32, 16)])
def test_a_one_sentence_ring_or_one_row_a_step_gives_the_same_tokens(ring_share, per_step_share, monkeypatch):
    # 64 rows: a ring of one sentence, or one row refilled a step (the copy's spare row takes the rest)
    monkeypatch.setattr(refill_device, "RING_SHARE", ring_share)
    monkeypatch.setattr(refill_device, "PER_STEP_SHARE", per_step_share)
    lines = source_lines(120)
    kw = dict(static_shapes=True, sync_every=4, **SMALL)
    assert Translator(MODEL, refill_on_device=True, **kw).translate(lines) == \
        Translator(MODEL, refill_on_device=False, **kw).translate(lines)


@trained
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, 200), min_size=17, max_size=60), every=st.integers(1, 9),
       max_tokens=st.sampled_from([17 * 16, 512, 2048]), max_sentences=st.integers(17, 80),
       a=st.sampled_from([0.0, 0.5, 1.5]), b=st.integers(1, 12), ring=st.sampled_from([1, 4, 0.5]))
def test_any_lines_blocks_caps_widths_and_rings_give_the_per_batch_tokens(picks, every, max_tokens,
                                                                          max_sentences, a, b, ring):
    pool = source_lines(200) + [""]  # an empty line stays empty, in its place
    lines = [pool[i] for i in picks]
    kw = dict(static_shapes=True, sync_every=every, max_tokens=max_tokens, max_sentences=max_sentences,
              max_len_a=a, max_len_b=b)
    refill_device.RING_SHARE, share = ring, refill_device.RING_SHARE
    try:
        got = Translator(MODEL, refill_on_device=True, **kw).translate(lines)
    finally:
        refill_device.RING_SHARE = share
    assert got == Translator(MODEL, **kw, refill_rows=False).translate(lines)


@trained
def test_no_row_waits_for_the_hosts_read_so_long_blocks_cost_no_steps(monkeypatch):
    lines = source_lines(300)
    runs = counted_blocks(monkeypatch)
    steps = {}
    for on_device in (False, True):
        for every in (4, 16):
            runs.clear()
            Translator(MODEL, static_shapes=True, sync_every=every, refill_on_device=on_device,
                       **SMALL).translate(lines)
            steps[on_device, every] = sum(r.block for r in runs)
    # the host's refill idles a row up to two blocks: longer blocks, more steps
    assert steps[False, 16] > steps[False, 4] + 32
    # on the device only the last block's rounding differs
    assert steps[True, 16] <= steps[True, 4] + 16 and steps[True, 4] <= steps[False, 4]


@trained
def test_rows_refilled_on_the_device_read_the_host_once_a_block(monkeypatch):
    tr = Translator(MODEL, static_shapes=True, sync_every=4, refill_on_device=True, **SMALL)
    runs = counted_blocks(monkeypatch)
    hostsync.reset()
    tr.translate(source_lines(120))
    assert len({id(r) for r in runs}) == 1  # one state, one graph, for the chunk
    assert hostsync.counts["finished?"] == len(runs)  # the slots' flags and the ring's head: one read
    assert 0 < hostsync.counts["outputs"] <= len(runs)
    assert set(hostsync.counts) == {"finished?", "outputs"}


@trained
def test_a_refilled_chunk_on_the_device_captures_its_block_once(monkeypatch):
    from test_graphs import on_cpu_with_graphs
    seen = on_cpu_with_graphs(monkeypatch)
    lines = source_lines(150)
    tr = Translator(MODEL, static_shapes=True, sync_every=4, refill_on_device=True, **SMALL)
    got = tr.translate(lines)
    assert got == Translator(MODEL, **SMALL).translate(lines)
    assert seen == {"warm": [id(tr.model)], "capture": [id(tr.model)]}  # the ring's ops in the block's graph


@trained
def test_early_start_with_rows_refilled_on_the_device_gives_the_chunk_encoded_whole():
    lines = source_lines(150)
    lines[3] = lines[140] = ""
    tr = Translator(MODEL, **STAGED, early_start=True, refill_on_device=True)
    assert tr.plan.early_start and tr.plan.refill_on_device
    assert tr.translate(lines) == Translator(MODEL, **STAGED).translate(lines)


def test_refill_on_device_resolves_with_refilled_rows_only():
    both = Kernels(cpu=True, cuda=True)
    assert not resolve(Switches(), device="cuda", kernels=both).refill_on_device  # off by default
    on = Switches(refill_on_device=True)
    assert resolve(on, device="cuda", kernels=both).refill_on_device
    assert "refill_on_device" in resolve(on, device="cuda", kernels=both).summary()
    assert not resolve(on, device="cuda", kernels=both, beam=4).refill_on_device
    assert not resolve(Switches(refill_on_device=True, refill_rows=False), device="cuda",
                       kernels=both).refill_on_device
    assert resolve(on, device="cpu", kernels=both, static_shapes=True).refill_on_device
