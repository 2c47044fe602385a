"""Beam search's row-table caches (switch kv_row_table): decoder/state.py RowTableCache's
storage and shrink, and the fixed-shape StaticCache (the CUDA graphs' beam state) moving its table
in place of its K/V buffer."""
import pytest
import torch

from decoder import Translator, hostsync
from decoder.state import RowTableCache, StaticCache
from fixture_model import make_model_dir, synthetic_corpus


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model_dir(tmp_path_factory.mktemp("fixture") / "model", seed=1)


@pytest.fixture(scope="module")
def srcs(model_dir):
    return Translator(model_dir, precision="fp32").text.encode(synthetic_corpus(24, seed=7))


def test_row_table_cache_stores_each_step_as_one_contiguous_block(model_dir, srcs, monkeypatch):
    seen = []

    def spy(self, *a, _f=RowTableCache.reorder):
        kc = self.kv[0, 0]  # (N, h, T, hd) view
        seen.append(kc[:, :, self.t - 1].is_contiguous())
        return _f(self, *a)
    monkeypatch.setattr(RowTableCache, "reorder", spy)
    Translator(model_dir, precision="fp32", beam=3).translate_ids(srcs[:6])
    assert seen and all(seen)


def test_row_table_shrink_keeps_each_kept_rows_history(model_dir, srcs, monkeypatch):
    """After keep(sents, rows), new row r at position j holds what old row table[rows[r], j] held."""
    checked = []

    def spy(self, sents, rows, _f=RowTableCache.keep):
        t = self.t
        src = self.table[:, :t].index_select(0, rows)  # (N', t)
        pos = torch.arange(t)
        want = self.kv[:, :, :, :, :t][:, :, src, :, pos].permute(2, 3, 0, 1, 4, 5).clone()  # (L, 2, N', t, h, hd)
        _f(self, sents, rows)
        got = self.kv[:, :, :, :, :t].permute(0, 1, 2, 4, 3, 5)
        assert torch.equal(got, want)
        assert torch.equal(self.table, torch.arange(rows.numel())[:, None].expand_as(self.table))
        checked.append(rows.numel())
    monkeypatch.setattr(RowTableCache, "keep", spy)
    Translator(model_dir, precision="fp32", beam=3).translate_ids(srcs)
    assert checked  # the fixture's batch shrank at least once


def test_beam_through_the_position_major_cache_equals_beam_moving_the_cache(model_dir, srcs):
    table = Translator(model_dir, precision="fp32", beam=4, kv_row_table=True).translate_ids(srcs)
    assert table == Translator(model_dir, precision="fp32", beam=4, kv_row_table=False).translate_ids(srcs)


STATIC_BEAM = dict(beam=4, static_shapes=True)  # the graphs' beam loop, eagerly


@pytest.mark.parametrize("kw", [dict(), dict(sync_every=3, max_sentences=5)])
def test_fixed_shape_beam_through_the_row_table_gives_the_tokens_of_the_moved_cache(model_dir, srcs, kw):
    table = Translator(model_dir, precision="fp32", kv_row_table=True, **STATIC_BEAM, **kw)
    moved = Translator(model_dir, precision="fp32", kv_row_table=False, **STATIC_BEAM, **kw)
    assert table.state_kind(5) == moved.state_kind(5) == "static"
    assert table.plan.states.row_table and not moved.plan.states.row_table
    assert table.translate_ids(srcs) == moved.translate_ids(srcs)
    # one sentence a batch, twice: the second of a shape reloads the state kept for it (graph_reuse)
    one = [srcs[0], srcs[1], srcs[0]]
    assert [table.translate_ids([s])[0] for s in one] == [moved.translate_ids([s])[0] for s in one]


def test_fixed_shape_beam_reorder_moves_the_row_table_and_leaves_the_cache(model_dir, srcs, monkeypatch):
    seen = []

    def spy(self, rows, _f=StaticCache.reorder):
        kv, table = self.kv.clone(), None if self.table is None else self.table.clone()
        _f(self, rows)
        seen.append((torch.equal(kv, self.kv), table is not None and not torch.equal(table, self.table)))
    monkeypatch.setattr(StaticCache, "reorder", spy)
    Translator(model_dir, precision="fp32", **STATIC_BEAM).translate_ids(srcs[:8])
    assert seen and all(same for same, _ in seen) and any(moved for _, moved in seen)
    seen.clear()
    Translator(model_dir, precision="fp32", kv_row_table=False, **STATIC_BEAM).translate_ids(srcs[:8])
    assert seen and not any(moved for _, moved in seen) and not all(same for same, _ in seen)
