"""`make distill` per device, without a GPU: the teacher `auto` trains, the default preset's
budgets, the sizes left to the trainer, and the batch settings the distillation stage passes
to the decoder (pure functions of the device kind)."""
import pytest
import torch

from student.distill.pipeline import (AUTO_TEACHER, DEVICE_DEFAULTS, DistillConfig, teacher_choice, train_config,
                                      train_stage_options)
from student.distill.teachers import REFERENCE_BATCHES, ModelTeacher, batch_options, make_teacher
from student.model import preset


def test_auto_teacher_is_one_table_entry_per_device():
    assert teacher_choice("auto", {}, "cpu") == ("teacher-tiny", {})
    assert teacher_choice("auto", {}, "cuda:0") == ("teacher-base", {"dropout": 0.3})
    assert teacher_choice("auto", {}, "cuda") == AUTO_TEACHER["cuda"]
    assert "teacher-big" not in AUTO_TEACHER["cuda"]  # measured on an H100: dev BLEU 3.0 in its budget


def test_teacher_set_wins_over_the_auto_entry_and_a_named_preset_is_kept():
    assert teacher_choice("auto", {"dropout": 0.1, "ffn_dim": 1024}, "cuda") == \
        ("teacher-base", {"dropout": 0.1, "ffn_dim": 1024})
    assert teacher_choice("teacher-big", {}, "cuda") == ("teacher-big", {})


def test_teacher_set_is_checked_on_the_teacher_the_device_trains(monkeypatch, capsys):
    """`auto` on a GPU trains teacher-base (d 512): 1,024 heads divide teacher-big's d 1024, not
    its, so the run is refused before any work, not at the teacher's first step."""
    from student.distill.__main__ import options
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        options(["--teacher-set", "n_heads=1024"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "must divide d_model 512" in err[0], err
    big = options(["--teacher-preset", "teacher-big", "--teacher-set", "n_heads=1024"])
    assert big.teacher_set == {"n_heads": 1024}
    # accepted on the GPU's teacher-base, where the CPU's teacher-tiny (d 256) would refuse it
    assert options(["--teacher-set", "n_heads=512"]).teacher_set == {"n_heads": 512}


def test_default_preset_on_cuda_takes_the_gpu_budgets_and_cpu_is_unchanged():
    cpu, gpu = DistillConfig.from_preset("default", device="cpu"), DistillConfig.from_preset("default", device="cuda")
    assert cpu == DistillConfig()
    assert (gpu.teacher_minutes, gpu.student_minutes) == (DEVICE_DEFAULTS["cuda"]["teacher_minutes"],
                                                          DEVICE_DEFAULTS["cuda"]["student_minutes"])
    # about 12 minutes end to end (the 20-minute target with room), so a lent 15-minute GPU session,
    # its start and build included, can measure the whole run
    assert gpu.teacher_minutes + gpu.student_minutes <= 9.5
    assert DistillConfig.from_preset("default", device="cuda", teacher_minutes=30).teacher_minutes == 30  # given wins
    assert DistillConfig.from_preset("wmt", device="cuda") == DistillConfig.from_preset("wmt", device="cpu")


def test_gpu_student_starts_from_the_gpu_teacher():
    """The CUDA defaults' student maps onto the auto teacher (student/train/init.py), so it is not
    trained from random weights."""
    from student.train.init import plan
    name, sets = AUTO_TEACHER["cuda"]
    student = DistillConfig.from_preset("default", device="cuda").student_preset
    p = plan(preset(student, vocab_size=8000), preset(name, vocab_size=8000, **sets))
    assert p.layers["encoder"] == list(range(preset(student).encoder_layers))


def test_training_sizes_are_numbers_on_cpu_and_the_trainers_on_cuda():
    cfg = DistillConfig()
    cpu = train_config(cfg, "teacher", "teacher-tiny", "a", "b", "cpu")
    assert (cpu.max_tokens, cpu.max_sentences, cpu.lr, cpu.warmup) == (3072, 256, 2e-3, 400)  # keys as before
    gpu = train_config(DistillConfig.from_preset("default", device="cuda"), "student", "student-6-1", "a", "b",
                       "cuda:0")
    assert (gpu.max_tokens, gpu.max_sentences, gpu.lr, gpu.warmup) == (None, None, None, None)
    assert train_stage_options(gpu)["train"]["max_tokens"] is None
    given = train_config(DistillConfig(max_tokens=8192, teacher_lr=1e-3), "teacher", "teacher-base", "a", "b", "cuda")
    assert (given.max_tokens, given.lr, given.warmup) == (8192, 1e-3, None)
    sets = train_config(cfg, "teacher", "teacher-base", "a", "b", "cuda", {"dropout": 0.3})
    assert sets.model_overrides == {"dropout": 0.3}


@pytest.mark.parametrize("engine,device,given,want", [
    ("decoder", "cuda", {}, {"max_tokens": None, "max_sentences": None}),  # the decoder's GPU default
    ("decoder", "cpu", {}, {}),                                            # its measured CPU defaults
    ("decoder", "cuda", {"max_tokens": 4096}, {"max_tokens": 4096, "max_sentences": None}),
    ("reference", "cpu", {}, dict(zip(("max_tokens", "max_sentences"), REFERENCE_BATCHES["cpu"]))),
    ("reference", "cuda", {}, dict(zip(("max_tokens", "max_sentences"), REFERENCE_BATCHES["cuda"]))),
    ("reference", "cuda", {"max_sentences": 8}, {"max_tokens": REFERENCE_BATCHES["cuda"][0], "max_sentences": 8}),
])
def test_distill_batches_per_device(engine, device, given, want):
    assert batch_options(engine, device, **given) == want


def test_reference_batches_on_cuda_are_larger_than_on_cpu():
    assert all(g > c for g, c in zip(REFERENCE_BATCHES["cuda"], REFERENCE_BATCHES["cpu"]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fixture_model import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("teacher") / "model", seed=3)


@pytest.mark.parametrize("cuda", [True, False])
def test_a_teacher_told_no_device_runs_where_the_pipeline_does(model_dir, cuda, monkeypatch):
    """make_teacher without a device: the device kind the pipeline's defaults and report read
    (decoder.machine.device_kind), with that device's precision and batches."""
    from decoder.machine import device_kind
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    t = make_teacher(model_dirs=[str(model_dir)], beam=4)
    assert t.device.type == device_kind() == ("cuda" if cuda else "cpu")
    assert (t.precision == "fp16") == cuda
    assert t.batches == ({"max_tokens": None, "max_sentences": None} if cuda else {})


def test_distill_teacher_on_cuda_leaves_the_batch_to_the_decoder(model_dir, monkeypatch):
    """What the distillation stage's teacher hands decoder.Translator on each device (not loaded:
    the options are decided at construction)."""
    gpu = make_teacher(model_dirs=[str(model_dir)], beam=4, device="cuda")
    assert gpu.engine == "decoder" and gpu.precision == "fp16"
    assert gpu.batches == {"max_tokens": None, "max_sentences": None}
    cpu = make_teacher(model_dirs=[str(model_dir)], beam=4, device="cpu")
    assert cpu.batches == {}
    seen = {}

    class Spy:
        def __init__(self, d, **kw):
            seen.update(kw)
            self.pool = None

    t = ModelTeacher([str(model_dir)], beam=4, engine="decoder", device="cuda", precision="fp16")
    t._Translator = Spy
    t.load()
    assert seen["max_tokens"] is None and seen["max_sentences"] is None and seen["device"] == "cuda"
    assert torch.device(seen["device"]).type == "cuda"
