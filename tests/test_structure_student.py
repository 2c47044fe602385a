"""One definition each: stage keys derived from the TrainConfig a stage trains, one packing
rule for token-budget batches, the model-dir contract's normaliser keys and position table,
one file digest, and the teachers' public surface the report uses."""
import dataclasses
import hashlib
import os

import numpy as np
import pytest

from conftest import toy_parallel
from decoder import modeldir
from decoder.batching import make_batches as decoder_batches
from decoder.batching import pack
from student.distill import pipeline
from student.distill.stages import stage_key
from student.train import TrainConfig


# -- stage keys -------------------------------------------------------------------------------------

def _changed(v, kind: str = ""):
    """Another value of v's kind; for None, of the field's annotated kind (`kind`, e.g. "int | None")."""
    if v is None and kind.split(" ")[0] in ("int", "float"):
        return {"int": 4096, "float": 1e-3}[kind.split(" ")[0]]
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 2 + 1
    if isinstance(v, str):
        return v + "-x"
    if v is None:
        return "x"
    if isinstance(v, dict):
        return {**v, "d_model": 7}
    if isinstance(v, (list, tuple)):
        return type(v)(x / 2 for x in v)
    raise TypeError(f"no change for {v!r}: teach _changed this field's type")


def _student_key(tc: TrainConfig) -> str:
    return stage_key("student", pipeline.train_stage_options(tc), ["upstream-key"])


def test_every_trainconfig_field_changes_the_stage_key_but_the_documented_exclusions():
    base = pipeline.train_config(pipeline.DistillConfig(), "student", "student-tiny", "d/train.src", "d/train.tgt")
    unkeyed = set()
    for f in dataclasses.fields(TrainConfig):
        tc = dataclasses.replace(base, **{f.name: _changed(getattr(base, f.name))})
        if _student_key(tc) == _student_key(base):
            unkeyed.add(f.name)
    # the documented list, and exactly it: paths whose content upstream keys fix, and where the run writes
    # (init_from: the teacher's dir; the student stages key the resolved init and the teacher upstream)
    assert pipeline.NOT_IN_STAGE_KEY == ("out_dir", "train_src", "train_tgt", "src", "tgt", "init_from")
    assert unkeyed == set(pipeline.NOT_IN_STAGE_KEY)


def test_every_distill_option_the_student_trains_with_changes_its_stage_key():
    base_cfg = pipeline.DistillConfig()

    def key(cfg):
        return _student_key(pipeline.train_config(cfg, "student", cfg.student_preset, "a", "b"))

    keyed = {f.name for f in dataclasses.fields(pipeline.DistillConfig)
             if key(dataclasses.replace(base_cfg, **{f.name: _changed(getattr(base_cfg, f.name), str(f.type))}))
             != key(base_cfg)}
    assert keyed == {"corpus", "src_lang", "tgt_lang", "dev_src", "dev_tgt", "test_src", "test_tgt", "vocab_size", "max_tokens", "eval_every", "save_every",
                     "dev_max", "patience", "amp", "seed", "student_preset", "student_set", "student_steps",
                     "student_minutes", "student_lr", "student_warmup"}


def test_a_training_stage_trains_exactly_the_config_its_key_was_derived_from(monkeypatch, tmp_path):
    trained, staged = [], []

    class Runner:
        def stage(self, name, options, upstream, work, finish=None):
            staged.append(options)
            work(str(tmp_path))
            return "key", str(tmp_path), None

    monkeypatch.setattr(pipeline, "train", trained.append)
    p = object.__new__(pipeline.Pipeline)
    p.runner = Runner()
    tc = pipeline.train_config(pipeline.DistillConfig(), "teacher", "teacher-tiny", "s", "t")
    p._train_stage("teacher", tc, [], None, average_last=3)
    assert trained == [dataclasses.replace(tc, out_dir=f"{tmp_path}/train")]
    assert staged == [pipeline.train_stage_options(tc, average_last=3)]


# -- batching ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_packing_covers_the_order_once_within_budget_and_each_batch_takes_all_that_fits(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 90, int(rng.integers(0, 300))).tolist()
    order = rng.permutation(len(lengths)).tolist()
    max_tokens, max_sentences = int(rng.integers(50, 800)), int(rng.integers(1, 40))
    batches = pack(order, lengths, max_tokens, max_sentences)
    assert [i for b in batches for i in b] == order  # consecutive runs, in order
    for b, nxt in zip(batches, batches[1:] + [None]):
        assert len(b) <= max_sentences
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= max_tokens
        if nxt:  # greedy: the next item did not fit
            grown = b + nxt[:1]
            assert len(grown) > max_sentences or max(lengths[i] for i in grown) * len(grown) > max_tokens
    assert decoder_batches(lengths, max_tokens, max_sentences) == \
        pack(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, max_tokens, max_sentences)


def test_training_batches_are_the_packing_of_their_length_order():
    from student.train.batching import make_batches
    rng = np.random.default_rng(1)
    s, t = rng.integers(1, 60, 400), rng.integers(1, 60, 400)
    got = make_batches(s, t, 500, 32, seed=2, epoch=0, shuffle=False)
    lens = np.maximum(s, t)
    order = np.lexsort((np.arange(len(lens)), lens))
    assert [b.tolist() for b in got] == pack(order.tolist(), lens.tolist(), 500, 32)


# -- the model-dir contract -------------------------------------------------------------------------

def test_a_normaliser_entry_missing_keys_normalises_the_same_in_training_and_decoding():
    import inspect

    from sacremoses import MosesPunctNormalizer

    from decoder.pipeline import make_normaliser
    from student.data import normalise
    assert set(modeldir.MOSES_KWARGS) <= set(inspect.signature(MosesPunctNormalizer).parameters)
    text = "a\x07 “b” ‘c’ – d…  e 1,5 ％"
    for entry in ({"type": "moses-punct", "src_lang": "en"},
                  {"type": "moses-punct", "src_lang": "en", "pre_replace_unicode_punct": True, "penn": False}):
        cfg = modeldir.ModelConfig(arch=modeldir.Arch(vocab_size=8, d_model=4, n_heads=1, ffn_dim=8,
                                                      encoder_layers=1, decoder_layers=1), normaliser=entry)
        assert normalise(text, "en", entry) == make_normaliser(cfg)(text)


def test_training_and_decoding_take_the_position_table_from_the_contract_module():
    import decoder.model
    import student.model
    assert student.model.sinusoidal_table is modeldir.sinusoidal_table
    assert decoder.model.sinusoidal_table is modeldir.sinusoidal_table
    t = modeldir.sinusoidal_table(10, 6, 1)  # (n_positions, dim)
    assert t.shape == (10, 6) and not t[1].any() and t[0, 3] == 1.0  # row 0: sin 0 = 0, cos 0 = 1


# -- digests ----------------------------------------------------------------------------------------

def test_file_and_dir_digests_keep_their_values(tmp_path):
    from student.data.pipeline import file_digest
    from student.distill.teachers import dir_digest
    (tmp_path / "sub").mkdir()
    files = {"b.bin": os.urandom(3 << 20), "a.txt": b"hello\n", "sub/c": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert file_digest(str(tmp_path / "b.bin")) == hashlib.sha256(files["b.bin"]).hexdigest()
    h = hashlib.sha256()  # the identity distill stage keys were made with: relpath \0 bytes, sorted walk
    for name in ("a.txt", "b.bin", "sub/c"):
        h.update(name.encode() + b"\0" + files[name])
    assert dir_digest(str(tmp_path)) == h.hexdigest()


# -- teachers' public surface -----------------------------------------------------------------------

def test_teachers_name_their_engine_publicly_with_the_precision_the_decoder_resolved(tmp_path):
    from fixture_model import make_model_dir

    from student.distill.teachers import CommandTeacher, ModelTeacher
    d = make_model_dir(tmp_path / "m", d_model=32, n_heads=2)
    dec = ModelTeacher([d], beam=2, engine="decoder", device="cpu", precision="fp32")
    ref = ModelTeacher([d], beam=2, engine="reference", device="cpu")
    assert (dec.engine_label(), ref.engine_label()) == ("decoder fp32", "reference")
    src, _ = toy_parallel(4, seed=1)
    assert len(ref.translate(src)) == len(dec.translate(src)) == 4
    cmd = CommandTeacher("cat")
    cmd.load()
    assert cmd.engine_label() == "external"


def test_report_describes_each_system_through_the_teacher_interface_alone(tmp_path):
    from student.distill import report

    class Teacher:  # the public surface only: no private attributes for the report to reach into
        name, engine, beam = "upper", "decoder", 3
        loaded = False

        def load(self):
            self.loaded = True

        def engine_label(self):
            return "decoder int8"

        def translate(self, lines, where=""):
            assert self.loaded, "translated before load(): loading would count as translation time"
            return [x.upper() for x in lines]

        def size(self):
            return {"params": 5, "bytes": 20}

    class Prep:
        src_lang, tgt_lang, dir = "en", "es", str(tmp_path)
        held_out = {"test": "the given test set"}

        def read(self, split):
            return ["a b", "c"], ["A B", "C"]

    cfg = dataclasses.replace(pipeline.DistillConfig(), name="t")
    report.evaluate(str(tmp_path), Prep(), [("teacher", Teacher(), [])], cfg, {"stages": {}}, log=lambda m: None)
    rep, md = report.load(str(tmp_path))
    (row,) = rep["systems"]
    assert (row["engine"], row["beam"], row["chrf"], row["size_params"]) == ("decoder int8", 3, 100.0, 5)
    assert "| decoder int8 |" in md
