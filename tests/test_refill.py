"""decoder/refill.py: a chunk's greedy sentences through one fixed-shape state whose finished
rows take the next sentences. On CPU the fixed-shape state runs eagerly (static_shapes),
the same ops a GPU captures: the tokens, the steps, the host reads, the segments."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoder import Translator, hostsync, refill, static_steps
from decoder.optimisations import Kernels, Switches, resolve
from decoder.translator import Options

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bible-tiny")
MODEL, SRC = os.path.join(HERE, "model"), os.path.join(HERE, "test.en")
trained = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "config.json")),
                             reason="trained fixture tests/fixtures/bible-tiny is absent")


def source_lines(n: int) -> list[str]:
    with open(SRC, encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh][:n]


def counted_blocks(monkeypatch) -> list:
    runs = []
    run = static_steps.StaticGreedy.run
    monkeypatch.setattr(static_steps.StaticGreedy, "run", lambda self, t: (runs.append(self), run(self, t))[1])
    return runs


# small batches, so that a state of max_tokens/16 rows is refilled many times
SMALL = dict(max_tokens=1024, max_sentences=64)


@trained
@pytest.mark.parametrize("kw", [dict(sync_every=1), dict(sync_every=3), dict(sync_every=8),
                                dict(sync_every=4, max_len_a=0.0, max_len_b=1),  # each sentence one forced </s>
                                dict(sync_every=4, graph_attention=True),
                                dict(sync_every=5, sort=False)])
def test_refilled_rows_give_the_per_batch_tokens_in_input_order(kw):
    lines = source_lines(150)
    lines[3] = lines[77] = ""  # empty lines stay empty and hold their place
    per_batch = Translator(MODEL, static_shapes=True, refill_rows=False, **SMALL, **kw)
    tr = Translator(MODEL, static_shapes=True, **SMALL, **kw)
    assert tr.plan.refill_rows and not per_batch.plan.refill_rows
    assert tr.translate(lines) == per_batch.translate(lines)
    caps = {k: v for k, v in kw.items() if k.startswith("max_len")}
    assert tr.translate(lines) == Translator(MODEL, **caps).translate(lines)  # the incremental state's


@trained
def test_a_refilled_state_runs_fewer_steps_than_its_batches(monkeypatch):
    lines = source_lines(300)
    per_batch = Translator(MODEL, static_shapes=True, refill_rows=False, sync_every=4, **SMALL)
    tr = Translator(MODEL, static_shapes=True, sync_every=4, **SMALL)
    runs = counted_blocks(monkeypatch)
    per_batch.translate(lines)
    batch_blocks = len(runs)
    runs.clear()
    out = tr.translate(lines)
    states = {id(r) for r in runs}
    assert len(states) == 1  # one state (and one graph) for the whole chunk
    rows = refill.rows_for(SMALL["max_tokens"], SMALL["max_sentences"], 1, 1)
    tokens = sum(len(tr.text.sp.encode(x)) + 1 for x in out)  # about the steps the outputs took
    assert len(runs) < batch_blocks
    assert len(runs) * 4 * rows >= tokens  # no fewer row-steps than the tokens written


@trained
def test_a_refilled_chunk_reads_the_finished_rows_once_a_block(monkeypatch):
    tr = Translator(MODEL, static_shapes=True, sync_every=4, **SMALL)
    runs = counted_blocks(monkeypatch)
    hostsync.reset()
    tr.translate(source_lines(120))
    assert hostsync.counts["finished?"] == len(runs)
    assert 0 < hostsync.counts["outputs"] <= len(runs)  # the rows finished in a block, one copy
    assert set(hostsync.counts) == {"finished?", "outputs"}


@trained
@pytest.mark.parametrize("n,kw", [(refill.MIN_SENTENCES, {}),  # a chunk of few sentences
                                  (40, dict(max_sentences=1)),  # batch 1: the latency mode's kept graphs
                                  (40, dict(max_tokens=16 * refill.MIN_SENTENCES))])  # a state of 16 rows
def test_few_sentences_or_rows_keep_the_per_batch_loop(n, kw, monkeypatch):
    tr = Translator(MODEL, static_shapes=True, sync_every=4, **kw)
    monkeypatch.setattr(refill, "refilled", lambda *a, **k: pytest.fail("refilled"))
    lines = source_lines(n)
    assert tr.translate(lines) == Translator(MODEL).translate(lines)
    assert refill.applies(17, 65536, 8192) and not refill.applies(16, 65536, 8192)


def test_rows_follow_the_token_budget_and_narrow_for_long_sentences():
    assert refill.rows_for(65536, 8192, 96, 154) == 4096  # the GPU's default: max_tokens / 16
    assert refill.rows_for(65536, 1024, 96, 154) == 1024  # at most max_sentences
    assert refill.rows_for(65536, 8192, 1000, 1023) == 16 * 65536 // 2023  # positions bounded
    assert refill.rows_for(16, 8192, 1000, 1023) == 1


def test_a_long_first_batch_gets_a_narrow_state_of_its_own():
    lengths = [1000, 900, 40, 40, 39, 30, 20]
    caps = [min(int(1.5 * n) + 10, 1023) for n in lengths]
    batches = [[0], [1], [2, 3], [4, 5], [6]]
    segs = refill.segments(batches, lengths, caps, 65536, 8192)
    assert segs == [(0, 2), (2, 5)]  # the rows allowed jump at batch 2; 40 -> 20 tokens does not double them
    assert refill.segments([[2, 3], [4, 5], [6]], lengths, caps, 65536, 8192) == [(0, 3)]
    assert refill.segments([], [], [], 65536, 8192) == []


@trained
def test_a_chunk_with_a_long_line_first_decodes_in_two_states(monkeypatch):
    lines = source_lines(80)
    lines[10] = " ".join(lines[:12])  # one line far longer than the rest
    kw = dict(static_shapes=True, sync_every=4, max_tokens=2048, max_sentences=64)
    runs = counted_blocks(monkeypatch)
    got = Translator(MODEL, **kw).translate(lines)
    assert len({id(r) for r in runs}) == 2
    assert got == Translator(MODEL, **{**kw, "refill_rows": False}).translate(lines)


def test_refill_resolves_with_the_greedy_whole_step_graphs_only():
    both = Kernels(cpu=True, cuda=True)
    assert resolve(Switches(), device="cuda", kernels=both).refill_rows
    assert not resolve(Switches(), device="cuda", kernels=both, beam=4).refill_rows
    assert not resolve(Switches(graph_steps=False), device="cuda", kernels=both).refill_rows
    assert not resolve(Switches(shortlist=True), device="cuda", kernels=both).refill_rows
    assert not resolve(Switches(), device="cpu", kernels=both).refill_rows  # no fixed-shape state there
    assert resolve(Switches(), device="cpu", kernels=both, static_shapes=True).refill_rows


@trained
def test_the_steps_tool_counts_every_loop_on_the_same_lines(tmp_path, monkeypatch):
    import json
    from tools import decode_steps
    made = []
    monkeypatch.setattr(decode_steps, "Translator", lambda *a, **kw: made.append(Translator(*a, **kw)) or made[-1])
    monkeypatch.setattr(static_steps, "NARROW_MIN", 4)  # the 64-row state narrows
    assert decode_steps.main(["--model", MODEL, "--src", SRC, "--lines", "300", "--max-tokens", "1024",
                              "--max-sentences", "64", "--sync-every", "4", "--out", str(tmp_path / "s")]) == 0
    assert [(t.opts.chunk_lines, t.plan.sync_every) for t in made] == [(Options.chunk_lines, 4)] * 5
    per_batch, refilled, narrowed, staged, on_device = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert refilled["steps"] < per_batch["steps"] and refilled["rows"] == on_device["rows"] == [64]
    assert narrowed["narrow_tail"] and not refilled["narrow_tail"]
    assert narrowed["rows"][-1] == 64 and len(narrowed["rows"]) > 2
    assert narrowed["row_steps"] < refilled["row_steps"] and narrowed["same_outputs"] == "300 of 300"
    assert on_device["steps"] < refilled["steps"]  # no row waits for the host's read
    assert refilled["same_outputs"] == staged["same_outputs"] == on_device["same_outputs"] == "300 of 300"
    assert staged["early_start"] and not refilled["early_start"]  # 300 lines: over two states' worth of 64 rows
    assert on_device["refill_on_device"] and not staged["refill_on_device"]
    md = (tmp_path / "s.md").read_text()
    assert "| refilled rows |" in md and "| refilled rows, the chunk's longest lines first (early_start) |" in md
    assert "| refilled rows on the device, each step (refill_on_device) |" in md
    assert "| refilled rows, the tail narrowed (narrow_tail) |" in md
    made.clear()  # --chunk-lines reaches the decoder: a run in chunks of 70 lines
    assert decode_steps.main(["--model", MODEL, "--src", SRC, "--lines", "140", "--max-tokens", "1024",
                              "--max-sentences", "64", "--chunk-lines", "70", "--out", str(tmp_path / "c")]) == 0
    assert {t.opts.chunk_lines for t in made} == {70}
    assert json.loads((tmp_path / "c.json").read_text())["settings"]["chunk_lines"] == 70


@trained
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, 200), min_size=17, max_size=60), every=st.integers(1, 9),
       max_tokens=st.sampled_from([17 * 16, 512, 2048]), max_sentences=st.integers(17, 80),
       a=st.sampled_from([0.0, 0.5, 1.5]), b=st.integers(1, 12), sort=st.booleans())
def test_any_lines_blocks_caps_and_widths_give_the_per_batch_tokens(picks, every, max_tokens, max_sentences,
                                                                      a, b, sort):
    pool = source_lines(200) + [""]  # an empty line stays empty, in its place
    lines = [pool[i] for i in picks]
    kw = dict(static_shapes=True, sync_every=every, max_tokens=max_tokens, max_sentences=max_sentences,
              max_len_a=a, max_len_b=b, sort=sort)
    tr = Translator(MODEL, **kw)
    assert tr.plan.refill_rows
    assert tr.translate(lines) == Translator(MODEL, **kw, refill_rows=False).translate(lines)


@trained
@pytest.mark.parametrize("ahead", [True, False])
def test_a_refilled_chunk_captures_its_block_once_and_replays_it(ahead, monkeypatch):
    from test_graphs import on_cpu_with_graphs
    seen = on_cpu_with_graphs(monkeypatch)
    lines = source_lines(150)
    tr = Translator(MODEL, static_shapes=True, sync_every=4, capture_ahead=ahead, **SMALL)
    runs = counted_blocks(monkeypatch)
    got = tr.translate(lines)
    assert got == Translator(MODEL, **{k: v for k, v in SMALL.items()}).translate(lines)
    assert len({id(r) for r in runs}) == 1 and len(runs) > 2
    assert seen == {"warm": [id(tr.model)], "capture": [id(tr.model)]}  # one graph for the chunk


# a state of 20 rows (max_sentences): early_start stages chunks of at least 40 lines
STAGED = dict(static_shapes=True, sync_every=4, max_tokens=2048, max_sentences=20)


def staged_spy(monkeypatch) -> list:
    """The Staged chunks Translator._stage returns."""
    from decoder import translator
    seen, stage = [], translator.Translator._stage
    monkeypatch.setattr(translator.Translator, "_stage",
                        lambda self, lines: (lambda r: (seen.append(r), r)[1])(stage(self, lines)))
    return seen


@trained
@pytest.mark.parametrize("chunk_lines", [150, 60])  # one chunk; the first of three staged, the others not
def test_early_start_gives_the_outputs_of_the_chunk_encoded_whole(chunk_lines, monkeypatch):
    from decoder.translator import Staged
    lines = source_lines(150)
    lines[3] = lines[77] = lines[140] = ""  # empty lines stay empty and hold their place
    spy = staged_spy(monkeypatch)
    tr = Translator(MODEL, **STAGED, early_start=True, chunk_lines=chunk_lines)
    assert tr.plan.early_start
    got = tr.translate(lines)
    assert [type(s) is Staged for s in spy] == [True]  # the first chunk only, once a run
    assert got == Translator(MODEL, **STAGED, chunk_lines=chunk_lines).translate(lines)
    spy.clear()
    assert tr.translate(lines) == got and len(spy) == 1  # each run stages its own first chunk


@trained
def test_early_start_gives_a_rest_sentence_longer_than_the_head_a_state_of_its_own(monkeypatch):
    # byte-fallback characters: few characters, many tokens; sorted by characters it is not in the head
    lines = source_lines(80)
    lines[50] = "漢字が" * 12
    tr = Translator(MODEL, **STAGED, early_start=True)
    head_chars = sorted(map(len, lines), reverse=True)[19]
    assert len(lines[50]) < head_chars and len(tr.text.encode([lines[50]])[0]) > max(
        len(x) for x in tr.text.encode(sorted(lines, key=len)[-20:]))
    runs = counted_blocks(monkeypatch)
    got = tr.translate(lines)
    assert len({id(r) for r in runs}) == 2  # the head's state, then the long one's
    assert got == Translator(MODEL, **STAGED).translate(lines)


@trained
def test_early_start_names_the_first_truncated_line_in_input_order(capfd):
    lines = source_lines(60)
    lines[5] = "漢" * 700  # over the model's 1,024 tokens in 700 characters: not among the longest
    for i in range(30, 55):
        lines[i] = "and the word of the lord came " * 30  # 900 characters, under the limit
    lines[57] = "the " * 1100  # over the limit, 4,400 characters: the longest
    tr = Translator(MODEL, **STAGED, early_start=True, max_len_a=0.0, max_len_b=2)
    assert len(tr.translate(lines)) == 60
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("warning:")]
    assert len(err) == 1 and err[0].startswith("warning: input line 6 has ")
    assert err[0].endswith("tokens; truncating lines to the model limit of 1024")


@trained
@pytest.mark.parametrize("ready", [False, True])
@pytest.mark.parametrize("floor", [static_steps.NARROW_MIN, 4])  # 4: the head's state would narrow, but the rest waits
def test_the_rest_is_taken_once_encoded_and_waited_for_only_when_no_row_is_busy(ready, floor, monkeypatch):
    from decoder.batching import make_batches
    monkeypatch.setattr(static_steps, "NARROW_MIN", floor)
    tr = Translator(MODEL, **STAGED, early_start=True)
    lines = source_lines(70)
    ids = tr.text.encode(lines)
    caps = tr.limits([len(x) for x in ids]).tolist()
    head, rest = list(range(20)), list(range(20, 70))
    srcs = [x if i < 20 else None for i, x in enumerate(ids)]
    finished: list[int] = []
    taken_after: list[int] = []

    def take():
        taken_after.append(len(finished))
        for i in rest:
            srcs[i] = ids[i]
        return [[rest[j] for j in b] for b in make_batches([len(ids[i]) for i in rest], 2048, 20)]
    batches = [[head[j] for j in b] for b in make_batches([len(ids[i]) for i in head], 2048, 20)]
    for done, out in refill.refilled(tr.model, tr.search, tr.encode_batch, batches, srcs, caps, 2048, 20,
                                     tr.phase, refill.More(lambda: ready, take)):
        finished += done
    assert sorted(finished) == list(range(70)) and len(taken_after) == 1
    # not ready: waited for once the head's 20 sentences were all out; ready: taken at the first read
    assert taken_after == ([20] if not ready else [0])


def test_a_state_narrows_by_halves_to_its_busy_rows_not_below_the_floor():
    assert static_steps.narrow_to(4096, 2048) == 2048 and static_steps.narrow_to(4096, 2049) == 4096
    assert static_steps.narrow_to(4096, 300) == 512 and static_steps.narrow_to(8192, 700) == 1024
    assert static_steps.narrow_to(4096, 3) == static_steps.NARROW_MIN == 256  # narrower steps would save nothing
    assert static_steps.narrow_to(300, 20) == 300  # half of it is under the floor
    assert static_steps.narrow_to(4096, 0) == 4096  # no busy row: the state ends as it is


def narrowing(monkeypatch, floor: int = 4) -> list:
    """States narrow down to `floor` rows; -> the calls, in order, of RefillGreedy.place and take_rows."""
    calls = []
    place, take = refill.RefillGreedy.place, refill.RefillGreedy.take_rows
    monkeypatch.setattr(static_steps, "NARROW_MIN", floor)
    monkeypatch.setattr(refill.RefillGreedy, "place", lambda self, *a: (calls.append(("place", self)), place(self, *a)))
    monkeypatch.setattr(refill.RefillGreedy, "take_rows", lambda self, old, rows: (
        calls.append(("take", self, old, rows.numel())), take(self, old, rows)))
    return calls


@trained
@pytest.mark.parametrize("kw", [dict(sync_every=4), dict(sync_every=1), dict(sync_every=7, max_len_a=0.5, max_len_b=3),
                                dict(sync_every=3, graph_attention=True), dict(sync_every=4, sort=False)])
def test_a_narrowed_tail_gives_the_per_batch_tokens_in_fewer_row_steps(kw, monkeypatch):
    lines = source_lines(150)
    lines[3] = lines[77] = ""
    wide = Translator(MODEL, static_shapes=True, narrow_tail=False, **SMALL, **kw)
    tr = Translator(MODEL, static_shapes=True, **SMALL, **kw)
    assert tr.plan.narrow_tail and not wide.plan.narrow_tail
    runs = counted_blocks(monkeypatch)
    before = wide.translate(lines)
    wide_rows = sum(r.done.shape[0] for r in runs)
    calls = narrowing(monkeypatch)
    runs.clear()
    got = tr.translate(lines)
    caps = {k: v for k, v in kw.items() if k.startswith("max_len")}
    assert got == before == Translator(MODEL, **caps).translate(lines)
    widths = [r.done.shape[0] for r in runs]
    assert widths == sorted(widths, reverse=True) and widths[0] == 64 and len(set(widths)) > 2
    assert sum(widths) < wide_rows  # the row-steps: blocks x rows
    takes = [i for i, c in enumerate(calls) if c[0] == "take"]
    assert takes and max(i for i, c in enumerate(calls) if c[0] == "place") < takes[0]  # once none waits
    for _, narrower, wider, busy in map(calls.__getitem__, takes):  # at least halved, every busy row kept
        assert busy <= narrower.done.shape[0] <= wider.done.shape[0] // 2


@trained
def test_a_narrowed_state_reads_its_rows_once_a_block_and_captures_its_own_block(monkeypatch):
    from test_graphs import on_cpu_with_graphs
    seen = on_cpu_with_graphs(monkeypatch)
    tr = Translator(MODEL, static_shapes=True, sync_every=4, **SMALL)
    runs = counted_blocks(monkeypatch)
    narrowing(monkeypatch)
    hostsync.reset()
    got = tr.translate(source_lines(150))
    states = len({id(r) for r in runs})
    assert states > 2 and hostsync.counts["finished?"] == len(runs)
    assert got == Translator(MODEL).translate(source_lines(150))
    assert seen["warm"] == seen["capture"] == [id(tr.model)] * states  # each state's block captured once


@trained
@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 200), min_size=17, max_size=60), every=st.integers(1, 9),
       max_sentences=st.integers(17, 80), floor=st.integers(1, 20), b=st.integers(1, 12))
def test_any_lines_blocks_and_floors_narrow_to_the_per_batch_tokens(picks, every, max_sentences, floor, b,
                                                                     monkeypatch):
    pool = source_lines(200) + [""]
    lines = [pool[i] for i in picks]
    kw = dict(static_shapes=True, sync_every=every, max_tokens=2048, max_sentences=max_sentences, max_len_b=b)
    with monkeypatch.context() as m:
        m.setattr(static_steps, "NARROW_MIN", floor)
        got = Translator(MODEL, **kw).translate(lines)
    assert got == Translator(MODEL, **kw, refill_rows=False).translate(lines)


def test_narrow_tail_resolves_with_the_hosts_refill_only():
    both = Kernels(cpu=True, cuda=True)
    assert resolve(Switches(), device="cuda", kernels=both).narrow_tail
    assert not resolve(Switches(refill_on_device=True), device="cuda", kernels=both).narrow_tail
    assert not resolve(Switches(), device="cuda", kernels=both, beam=4).narrow_tail
    assert not resolve(Switches(refill_rows=False), device="cuda", kernels=both).narrow_tail
