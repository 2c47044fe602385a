"""WMT-sized corpora in bounded memory: streamed preparation, hash dedup spilling to disk,
the byte-bounded SentencePiece sample, the encoded corpus on disk, batches from lengths."""
import os
import random
import tracemalloc

import numpy as np
import pytest
import sentencepiece as spm

from decoder.batching import pack
from student.data import clean_pairs, indexed, normalise, pipeline, prepare
from student.data.clean import Cleaner
from student.data.dedup import Dedup
from student.data.sample import Sample
from student.train.batching import make_batches, pack_ascending, shard
from tools.synth_corpus import generate


@pytest.fixture(scope="module")
def synth4000(tmp_path_factory):
    return generate(4000, str(tmp_path_factory.mktemp("synth")), "en", "de", seed=1, verbose=False)


def head(paths, n, d):
    """The first n pairs of a corpus, as files in d."""
    os.makedirs(d, exist_ok=True)
    out = []
    for p in paths:
        with open(p, encoding="utf-8") as fh:
            lines = fh.read().splitlines(keepends=True)[:n]
        out.append(os.path.join(d, os.path.basename(p)))
        with open(out[-1], "w", encoding="utf-8") as fh:
            fh.writelines(lines)
    return out


def test_prepare_peak_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch, synth4000):
    # bounds scaled down so that 4,000 pairs cross each of them several times
    monkeypatch.setattr(pipeline, "CHUNK", 250)
    monkeypatch.setattr(pipeline, "SPM_SAMPLE_PAIRS", 200)
    monkeypatch.setattr(pipeline, "DEDUP_BOUND", 500)
    held = head(synth4000, 50, str(tmp_path / "held"))  # the same dev and test for every size
    peaks = {}
    for n in (300, 1000, 4000):  # 300: first-use costs (regexes, imports) land outside the measure
        src, tgt = head(synth4000, n, str(tmp_path / str(n)))
        tracemalloc.start()
        p = prepare(src=src, tgt=tgt, dev_src=held[0], dev_tgt=held[1], test_src=held[0], test_tgt=held[1],
                    data_dir=str(tmp_path / "data"), vocab_size=400, verbose=False)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert p.counts["train"] == n and not any(p.counts["removed"].values())  # nothing lost
        assert p.counts["spm_sample_pairs"] == 200
    # measured: 1.1x streamed; 4.1x with the whole corpus in one chunk, as before streaming
    assert peaks[4000] < 1.3 * peaks[1000], peaks


def test_dedup_keeps_first_occurrences_across_spilled_runs(tmp_path):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 3000, 20_000).astype(np.uint64)  # many repeats, far past the bound
    d = Dedup(str(tmp_path / "spill"), bound=500)
    got = np.concatenate([d.first_seen(c) for c in np.array_split(stream, 37)])
    assert len(d.runs) >= 3  # the later chunks were checked against runs on disk
    seen, want = set(), []
    for h in stream.tolist():
        want.append(h not in seen)
        seen.add(h)
    assert got.tolist() == want
    d.close()
    assert not os.path.exists(tmp_path / "spill")


def test_streamed_cleaning_with_spills_equals_cleaning_in_memory(tmp_path):
    rng = random.Random(1)
    pairs = [(f"a {rng.randrange(300)} b", f"c {rng.randrange(3)} d") for _ in range(5000)]
    pairs += [("", "x"), ("one\x01two", "y z"), ("a " * 300, "b " * 300), ("a b c d e f g", "h")]
    rng.shuffle(pairs)
    kept, counts = clean_pairs(pairs)
    c = Cleaner(200, 0.3, 2.0, str(tmp_path / "spill"), bound=64)
    streamed = [p for i in range(0, len(pairs), 333) for p in c.chunk(pairs[i:i + 333])[0]]
    c.close()
    assert streamed == kept and c.counts == counts
    assert counts["duplicate"] > 4000 and min(counts[k] for k in ("empty", "control_chars", "too_long", "ratio"))


def test_spm_sample_stays_within_its_bounds_and_keeps_a_small_stream_whole():
    items = [("x" * (i % 50), str(i)) for i in range(3000)]
    sizes = [len(a) + len(b) for a, b in items]
    s = Sample(max_items=10_000, max_bytes=20_000, seed=3)
    for i in range(0, 3000, 250):
        s.add(items[i:i + 250], sizes[i:i + 250])
    assert s.bytes <= 20_000 and 0 < len(s) < 3000
    got = s.items()
    assert got == sorted(got, key=lambda p: int(p[1]))  # stream order
    again = Sample(10_000, 20_000, seed=3)
    again.add(items, sizes)  # other chunking, same draws
    assert again.items() == got
    capped = Sample(100, 10 ** 9, seed=3)
    capped.add(items, sizes)
    assert len(capped) == 100
    whole = Sample(10_000, 10 ** 9, seed=3)
    whole.add(items, sizes)
    assert whole.items() == items


def old_make_batches(src_lens, tgt_lens, max_tokens, max_sentences, seed, epoch, shuffle=True):
    """student.train.batching.make_batches before it built arrays: the reference."""
    rng = np.random.default_rng([seed, epoch])
    lens = np.maximum(np.asarray(src_lens), np.asarray(tgt_lens))
    order = np.lexsort((rng.random(len(lens)) if shuffle else np.arange(len(lens)), lens))
    batches = [np.asarray(b) for b in pack(order.tolist(), lens.tolist(), max_tokens, max_sentences)]
    return [batches[i] for i in rng.permutation(len(batches))] if shuffle else batches


def test_batches_from_lengths_are_the_batches_of_the_list_packer_for_every_rank():
    rng = np.random.default_rng(0)
    for t in range(60):
        n = int(rng.integers(1, 2000))
        s, tl = rng.integers(1, 300, n), rng.integers(1, 300, n)
        mt, ms, shuffle = int(rng.integers(1, 4000)), int(rng.integers(1, 300)), bool(t % 3)
        want = old_make_batches(s, tl, mt, ms, 5, t, shuffle)
        got = make_batches(s, tl, mt, ms, 5, t, shuffle)
        assert [b.tolist() for b in got] == [b.tolist() for b in want]
        for world in (2, 3):
            n_even = len(want) // world * world
            for rank in range(world):
                assert [b.tolist() for b in shard(got, rank, world)] == [b.tolist() for b in want[rank:n_even:world]]
    assert pack_ascending(np.array([5, 5, 9000, 9000]), 20, 10).tolist() == [0, 2, 3, 4]  # oversize alone


def test_resumed_position_reads_the_batches_an_unbroken_epoch_would():
    rng = np.random.default_rng(1)
    s = rng.integers(1, 80, 3000)
    epoch = shard(make_batches(s, s, 500, 64, seed=2, epoch=4), 1, 2)
    resumed = shard(make_batches(s, s, 500, 64, seed=2, epoch=4), 1, 2)  # rebuilt after a restart
    for idx in range(0, len(epoch), 3):  # accumulation groups of 3 from batch_idx on
        assert [b.tolist() for b in resumed[idx:idx + 3]] == [b.tolist() for b in epoch][idx:idx + 3]


@pytest.fixture(scope="module")
def toy_prepared(tmp_path_factory, synth4000):
    d = tmp_path_factory.mktemp("toy")
    src, tgt = head(synth4000, 400, str(d))
    return prepare(src=src, tgt=tgt, data_dir=str(d / "data"), vocab_size=400, verbose=False)


@pytest.fixture
def toy_encoded(toy_prepared, monkeypatch):
    monkeypatch.setattr(indexed, "SHARD", 70)
    return toy_prepared, *toy_prepared.splits["train"]


def encode(p, src, tgt, out, **kw):
    return indexed.encode(src, tgt, p.spm_model, (p.src_lang, p.tgt_lang), p.normaliser, out, verbose=False, **kw)


def test_encoded_corpus_is_memory_mapped_and_holds_what_encoding_in_memory_gives(toy_encoded, tmp_path):
    p, src, tgt = toy_encoded
    enc = encode(p, src, tgt, str(tmp_path / "enc"))
    sp = spm.SentencePieceProcessor(model_file=p.spm_model)
    for side, path, lang in (("src", src, p.src_lang), ("tgt", tgt, p.tgt_lang)):
        lines = open(path, encoding="utf-8").read().splitlines()
        want = [x[:indexed.LIMIT] + [sp.eos_id()] for x in sp.encode([normalise(x, lang, p.normaliser) for x in lines])]
        assert [enc[side][i].tolist() for i in range(len(enc))] == want
        assert all(isinstance(t, np.memmap) for t in enc[side].tokens)  # on disk, not in memory
        assert enc.lengths()[side == "tgt"].tolist() == [len(x) for x in want]
    assert len(enc.meta["shards"]) == 6 and enc[side].tokens[0].dtype == np.uint16


def test_training_input_holds_twelve_bytes_a_pair_whatever_the_corpus(toy_encoded, tmp_path):
    # the trainer's only arrays that grow with the corpus: the lengths and the epoch's order
    p, src, tgt = toy_encoded
    enc = encode(p, src, tgt, str(tmp_path / "enc"))
    lens = enc.lengths()
    batches = make_batches(*lens, 3072, 512, seed=1, epoch=0)
    assert sum(x.nbytes for x in lens) + batches.order.nbytes == 12 * len(enc)
    assert all(isinstance(x, np.ndarray) and not isinstance(x, np.memmap) for x in lens)
    assert batches[0].dtype == np.int64  # what collate indexes with is unchanged


def test_a_killed_encoding_redoes_only_its_missing_shards(toy_encoded, tmp_path):
    p, src, tgt = toy_encoded
    out = str(tmp_path / "enc")
    whole = [encode(p, src, tgt, out)["src"][i].tolist() for i in range(len(p.read("train")[0]))]
    os.remove(os.path.join(out, "meta.json"))
    os.remove(os.path.join(out, "idx-00003.npy"))  # shard 3 never finished
    kept = os.stat(os.path.join(out, "src-00002.npy")).st_mtime_ns
    again = encode(p, src, tgt, out)
    assert os.stat(os.path.join(out, "src-00002.npy")).st_mtime_ns == kept
    assert [again["src"][i].tolist() for i in range(len(again))] == whole


def test_two_ranks_encode_the_same_shards_and_read_the_single_process_batches(toy_encoded, tmp_path):
    p, src, tgt = toy_encoded
    one = encode(p, src, tgt, str(tmp_path / "one"))
    two = str(tmp_path / "two")
    os.makedirs(two)
    indexed._encode_shards(src, tgt, p.spm_model, (p.src_lang, p.tgt_lang), p.normaliser, two, 1, 2, False)
    both = encode(p, src, tgt, two, rank=0, world=2)  # rank 0's shards, then the index of all
    for f in sorted(os.listdir(str(tmp_path / "one"))):
        if f.endswith(".npy"):
            assert open(tmp_path / "one" / f, "rb").read() == open(os.path.join(two, f), "rb").read(), f
    lens = one.lengths()
    single = make_batches(*lens, 300, 64, seed=1, epoch=0)
    ranks = [shard(make_batches(*both.lengths(), 300, 64, seed=1, epoch=0), r, 2) for r in (0, 1)]
    for k in range(3):  # step k: rank 0 takes batch 2k, rank 1 batch 2k+1, as one process would in turn
        for r in (0, 1):
            idx = ranks[r][k]
            assert idx.tolist() == single[2 * k + r].tolist()
            assert [both["src"][i].tolist() for i in idx] == [one["src"][i].tolist() for i in idx]


def test_distillation_reads_its_source_file_a_shard_at_a_time_as_it_would_the_lines(tmp_path):
    from student.distill.filter import clean_distilled, iter_clean_distilled
    from student.distill.shards import assemble, translate_shards

    class Upper:
        def translate(self, lines, where=""):
            return [x.upper() for x in lines]
    lines = [f" line {i} " for i in range(23)]
    path = tmp_path / "src.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    a = translate_shards(Upper(), [x.strip() for x in lines], str(tmp_path / "a"), 5, verbose=False)
    b = translate_shards(Upper(), str(path), str(tmp_path / "b"), 5, verbose=False)
    assert assemble(str(tmp_path / "a"), 23, 5) == assemble(str(tmp_path / "b"), 23, 5)
    assert a["words"] == b["words"] and a["sentences"] == b["sentences"] == 23
    src = ["a b c", "x", "the the the the the the", "same text here", ""]
    hyp = ["d e f", "y", "ok", "same text here", "z"]
    counts = {}
    assert list(iter_clean_distilled(zip(src, hyp), counts)) == list(zip(*clean_distilled(src, hyp)[:2]))
    assert counts == clean_distilled(src, hyp)[2]


# -- the benchmark's two torchrun ranks against one process (student.data.bench --ranks) --------------

def fake_child(d, params, losses, shards="s", world=1):
    """What a bench child reports, with its parameter dump(s) in d."""
    import torch
    os.makedirs(d, exist_ok=True)
    for r in range(world):
        torch.save(params, os.path.join(d, f"rank{r}.pt"))
    return {"dump": str(d), "world": world, "losses": losses, "prepared": "p", "shards_sha256": shards}


def test_rank_comparison_reports_each_difference(tmp_path):
    import torch
    from student.data.ranks import compare, shards_digest
    w = {"a": torch.arange(6.0).view(2, 3), "b": torch.zeros(0)}
    one = fake_child(tmp_path / "one", w, [[1.5, 2.5]])
    same = compare(one, fake_child(tmp_path / "two", w, [[1.5, 2.5]], world=2))
    assert all(same[k] for k in ("same_prepared_dir", "shards_identical", "losses_equal", "params_equal",
                                 "replicas_equal")) and same["max_abs_param_diff"] == same["max_loss_diff"] == 0
    moved = {"a": w["a"] + torch.tensor([0, 0, 0, 0, 0, 1e-6]).view(2, 3), "b": w["b"]}
    other = compare(one, fake_child(tmp_path / "three", moved, [[1.5, 2.25]], shards="t"))
    assert not any(other[k] for k in ("shards_identical", "losses_equal", "params_equal"))
    assert other["max_loss_diff"] == 0.25 and 0 < other["max_abs_param_diff"] < 2e-6
    torch.save(moved, tmp_path / "two" / "rank1.pt")  # the replicas drifted apart
    assert not compare(one, {**one, "dump": str(tmp_path / "two"), "world": 2})["replicas_equal"]
    enc = tmp_path / "enc"
    enc.mkdir()
    for name in ("src-00000.npy", "idx-00000.npy"):
        np.save(enc / name, np.arange(5, dtype=np.uint16))
    digest = shards_digest(str(enc))
    np.save(enc / "src-00000.npy", np.array([0, 1, 2, 3, 5], dtype=np.uint16))
    assert shards_digest(str(enc)) != digest


def test_bench_two_torchrun_ranks_encode_and_step_as_one_process(tmp_path, synth4000, monkeypatch):
    from student.data import bench
    src, tgt = head(synth4000, 400, str(tmp_path / "corpus"))
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))  # no prepare phase: the first child prepares
    a = bench.parse_args(["--src", src, "--tgt", tgt, "--work", str(tmp_path), "--vocab-size", "400",
                          "--max-tokens", "600", "--shard-pairs", "150", "--ranks", "2", "--steps", "2"])
    r = bench.ranks_phase(a, str(tmp_path / "bench.log"))  # 3 shards: rank 0 encodes 0 and 2, rank 1 shard 1
    assert r["shards_identical"] and r["same_prepared_dir"] and r["replicas_equal"], r
    assert r["losses_equal"] and r["params_equal"] and r["max_abs_param_diff"] == 0, r
    assert len(r["one_process"]["losses"]) == 2 and all(len(x) == 2 for x in r["2_ranks"]["losses"])
    assert r["2_ranks"]["pairs"] == r["one_process"]["pairs"] == 360  # 5% each held out for dev and test
