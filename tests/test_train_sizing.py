"""The trainer's batch, learning rate and warm-up per device (student/train/sizing.py): pure
functions of the free GPU memory and the model's shape, pinned without a GPU."""
import pytest
import torch

from student.model import preset
from student.train import sizing
from student.train.sizing import (GPU_CEILING_TOKENS, GPU_FLOOR_TOKENS, REF_LR, REF_SENTENCES, REF_TOKENS,
                                  REF_WARMUP, Shape, gpu_batch_tokens, resolve, scaled_lr, scaled_warmup)

GiB = 2 ** 30


def shape(name: str, vocab: int = 8000) -> Shape:
    return Shape.of(preset(name, vocab_size=vocab))


def test_shape_counts_the_parameters_of_the_model_it_describes():
    from student.model import Transformer
    for name in ("student-6-1", "teacher-base"):
        args = preset(name, vocab_size=8000)
        real = sum(p.numel() for n, p in Transformer(args).named_parameters() if "norm" not in n and "bias" not in n)
        assert abs(Shape.of(args).params - real) / real < 0.01, name  # norms and biases left out


@pytest.mark.parametrize("free_gib,model,want", [
    (80, "student-6-1", GPU_CEILING_TOKENS),   # an H100: memory is no limit, the measured ceiling is
    (16, "student-6-1", GPU_CEILING_TOKENS),   # a 16 GB card still fits the ceiling for a 6-1 student
    (80, "teacher-big", GPU_CEILING_TOKENS),
    (16, "teacher-big", 8192),                 # a big model on a 16 GB card: what fits, rounded down
    (1, "student-6-1", GPU_FLOOR_TOKENS),      # almost nothing free: the floor, never zero
    (0, "teacher-big", GPU_FLOOR_TOKENS),
])
def test_gpu_batch_from_free_memory(free_gib, model, want):
    assert gpu_batch_tokens(free_gib * GiB, shape(model)) == want


def test_gpu_batch_never_shrinks_as_free_memory_grows():
    for model in ("student-tiny", "student-6-1", "teacher-base", "teacher-big"):
        sizes = [gpu_batch_tokens(int(g * GiB), shape(model)) for g in [x / 4 for x in range(0, 400)]]
        assert sizes == sorted(sizes), model
        assert all(s % sizing.GPU_ROUND == 0 and GPU_FLOOR_TOKENS <= s <= GPU_CEILING_TOKENS for s in sizes)


def test_gpu_batch_shrinks_for_a_wider_model_or_a_larger_vocabulary():
    free = 12 * GiB
    assert gpu_batch_tokens(free, shape("teacher-big")) < gpu_batch_tokens(free, shape("teacher-base"))
    assert shape("student-6-1", 32000).bytes_per_token() > shape("student-6-1", 8000).bytes_per_token()


def test_cpu_keeps_the_measured_recipe_whatever_the_memory():
    for free in (None, 0, 80 * GiB):
        s = resolve("cpu", free, shape("teacher-tiny"))
        assert (s.max_tokens, s.max_sentences, s.lr, s.warmup) == (REF_TOKENS, REF_SENTENCES, REF_LR, REF_WARMUP)


def test_cuda_default_batch_scales_lr_by_sqrt_and_keeps_warmup_tokens():
    s = resolve("cuda", 80 * GiB, shape("student-6-1"))
    assert s.max_tokens == GPU_CEILING_TOKENS and s.max_sentences == GPU_CEILING_TOKENS // 8
    assert s.lr == pytest.approx(REF_LR * 1.5)  # sqrt(24576 / 3072) = 2.83, capped at 1.5x
    assert s.warmup == 100  # 50 steps would hold the reference's warm-up tokens; Adam's floor is 100
    assert "80.0 GiB free" in s.why
    s = resolve("cuda", 80 * GiB, shape("student-6-1"), max_tokens=8192)
    assert s.warmup * s.max_tokens >= REF_WARMUP * REF_TOKENS > (s.warmup - 1) * s.max_tokens


def test_lr_rule_sqrt_between_one_and_the_cap():
    assert scaled_lr(REF_TOKENS) == REF_LR
    assert scaled_lr(1024) == REF_LR  # smaller batches keep the measured recipe
    assert scaled_lr(2 * REF_TOKENS) == pytest.approx(2 ** 0.5 * REF_LR)  # sqrt, under the cap
    assert scaled_lr(4 * REF_TOKENS) == pytest.approx(sizing.LR_SCALE_CAP * REF_LR)  # sqrt would be 2x
    assert scaled_lr(64 * REF_TOKENS) == pytest.approx(sizing.LR_SCALE_CAP * REF_LR)
    lrs = [scaled_lr(t) for t in range(512, 100_000, 512)]
    assert lrs == sorted(lrs)


def test_warmup_is_counted_in_tokens_with_a_floor_for_adam():
    assert scaled_warmup(REF_TOKENS) == REF_WARMUP and scaled_warmup(300) == REF_WARMUP
    assert scaled_warmup(2 * REF_TOKENS) == REF_WARMUP // 2
    assert scaled_warmup(6144 - 1) == 201  # rounded up: never fewer warm-up tokens than the reference
    assert scaled_warmup(24576) == 100  # 50 steps hold the tokens; Adam's beta2 0.98 wants 100
    assert scaled_warmup(24576, beta2=0.9) == 50


def test_explicit_values_always_win():
    s = resolve("cuda", 80 * GiB, shape("student-6-1"), max_tokens=4096, max_sentences=100, lr=1e-4, warmup=7)
    assert (s.max_tokens, s.max_sentences, s.lr, s.warmup) == (4096, 100, 1e-4, 7)
    s = resolve("cuda", 1 * GiB, shape("teacher-big"), max_tokens=32768)  # explicit batch past memory: as given
    assert s.max_tokens == 32768 and s.lr == pytest.approx(scaled_lr(32768)) and "given" in s.why
    s = resolve("cpu", None, shape("teacher-tiny"), max_tokens=400)  # the tests' small batches: recipe unchanged
    assert (s.lr, s.warmup, s.max_sentences) == (REF_LR, REF_WARMUP, REF_SENTENCES)


@pytest.mark.parametrize("amp,device,cpu_bf16,cuda_bf16,want", [
    ("auto", "cuda", False, True, (torch.bfloat16, False)),   # H100, A100: bf16, no loss scaling
    ("auto", "cuda", False, False, (torch.float16, True)),    # V100, T4: fp16 with a scaler
    ("fp16", "cuda", False, True, (torch.float16, True)),
    ("bf16", "cuda", False, True, (torch.bfloat16, False)),
    ("off", "cuda", False, True, (None, False)),
    ("auto", "cpu", True, False, (torch.bfloat16, False)),
    ("auto", "cpu", False, False, (None, False)),
    ("fp16", "cpu", False, False, (None, False)),
])
def test_autocast_dtype_per_device(amp, device, cpu_bf16, cuda_bf16, want):
    assert sizing.amp_dtype_for(amp, device, cpu_bf16, cuda_bf16) == want


def test_resolve_sizes_keeps_a_resumed_runs_sizes_and_fills_only_the_defaults():
    from student.train.trainer import TrainConfig, resolve_sizes
    cpu = torch.device("cpu")
    cfg, line = resolve_sizes(TrainConfig(out_dir="", preset="teacher-tiny"), cpu, 8000)
    assert (cfg.max_tokens, cfg.max_sentences, cfg.lr, cfg.warmup) == (3072, 256, 2e-3, 400) and "CPU recipe" in line
    saved = {"max_tokens": 24576, "max_sentences": 3072, "lr": 4e-3, "warmup": 100}
    cfg, line = resolve_sizes(TrainConfig(out_dir="", preset="teacher-tiny", lr=1e-3), cpu, 8000, saved)
    assert (cfg.max_tokens, cfg.max_sentences, cfg.lr, cfg.warmup) == (24576, 3072, 1e-3, 100)
    assert "resumed" in line


def test_trainer_and_speed_tool_train_at_the_resolved_size(toy_files, tmp_path, monkeypatch):
    """A config that leaves the batch to the device trains at the size resolve_sizes picks (CPU: the
    recipe), the trainer writes it to OUT/sizes.json, and student.train.speed times that size."""
    import json
    from student.train import speed
    from student.train.trainer import Corpus, TrainConfig, Trainer
    monkeypatch.setenv("KIT_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "run"
    out.mkdir()
    cfg = TrainConfig(out_dir=str(out), preset="student-tiny", src=str(toy_files / "train.en"),
                      tgt=str(toy_files / "train.es"), src_lang="en", tgt_lang="es", vocab_size=320, amp="off",
                      model_overrides=dict(d_model=32, n_heads=2, ffn_dim=64, encoder_layers=1),
                      eval_every=0, save_every=0, test_at_end=False)
    corpus = Corpus(cfg, verbose=False)
    t = Trainer(cfg, corpus, torch.device("cpu"), ddp=False)
    assert (t.cfg.max_tokens, t.cfg.lr, t.cfg.warmup) == (REF_TOKENS, REF_LR, REF_WARMUP)
    assert t.opt.param_groups[0]["initial_lr"] == REF_LR
    assert json.loads((out / "sizes.json").read_text())["max_tokens"] == REF_TOKENS
    r = speed.run(cfg, corpus, steps=3, warm=1)
    assert r["max_tokens"] == REF_TOKENS and r["tokens_s"] > 0
    assert speed.batch_list("3072,auto") == [3072, None]
    with pytest.raises(Exception):
        speed.batch_list("3072,big")
