"""Unit behaviour of the trainer's parts: loss, batches, LR schedule, averaging."""
import os

import numpy as np
import torch
import torch.nn.functional as F

from student.model import ModelArgs, Transformer
from student.train.batching import collate, make_batches, shard
from student.train.loss import label_smoothed_nll
from student.train.trainer import inv_sqrt_lr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_label_smoothed_loss_matches_direct_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(3, 11, (3, 5))
    target[0, 3:] = 1  # padding is ignored
    eps = 0.1
    loss, nll, n = label_smoothed_nll(logits, target, eps, pad_id=1)
    # direct: cross-entropy against the smoothed distribution q = (1-eps)*onehot + eps/V
    q = torch.full((3, 5, 11), eps / 11)
    q.scatter_add_(2, target[..., None], torch.full((3, 5, 1), 1 - eps))
    per_tok = -(q * F.log_softmax(logits, -1)).sum(-1)
    mask = target != 1
    assert n == int(mask.sum())
    torch.testing.assert_close(loss, per_tok[mask].sum())
    torch.testing.assert_close(nll, F.cross_entropy(logits[mask], target[mask], reduction="sum"))
    # and the same as torch's own label smoothing
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=1,
                                                     label_smoothing=eps, reduction="sum"))


def test_batches_cover_every_sentence_once_under_token_budget():
    rng = np.random.default_rng(0)
    s, t = rng.integers(1, 60, 500), rng.integers(1, 60, 500)
    batches = make_batches(s, t, max_tokens=300, max_sentences=32, seed=3, epoch=0)
    idx = np.concatenate(batches)
    assert sorted(idx.tolist()) == list(range(500))
    for b in batches:
        assert len(b) <= 32
        assert len(b) == 1 or max(np.maximum(s[b], t[b])) * len(b) <= 300


def test_batches_depend_only_on_seed_and_epoch():
    s = list(range(1, 200))
    a = make_batches(s, s, 256, 64, seed=1, epoch=2)
    b = make_batches(s, s, 256, 64, seed=1, epoch=2)
    c = make_batches(s, s, 256, 64, seed=1, epoch=3)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a, c))


def test_batches_group_similar_lengths():
    s = np.arange(1, 401)
    batches = make_batches(s, s, max_tokens=2000, max_sentences=1000, seed=0, epoch=0)
    spread = max(int(s[b].max() - s[b].min()) for b in batches)
    assert spread < 60  # sorted grouping, not random mixing (which would spread ~400)


def test_shards_are_disjoint_and_equal_sized():
    batches = [np.array([i]) for i in range(11)]
    r0, r1 = shard(batches, 0, 2), shard(batches, 1, 2)
    assert len(r0) == len(r1) == 5
    assert not set(int(b[0]) for b in r0) & set(int(b[0]) for b in r1)


def test_collate_shifts_target_right_after_start_token():
    src, tgt = [[5, 6, 2]], [[7, 8, 9, 2]]
    s, ti, to = collate(src, tgt, [0], pad_id=1, start_id=2, eos_id=2)
    assert s.tolist() == [[5, 6, 2]]
    assert ti.tolist() == [[2, 7, 8, 9]]
    assert to.tolist() == [[7, 8, 9, 2]]


def test_inverse_sqrt_schedule_peaks_at_warmup():
    assert inv_sqrt_lr(50, 1e-3, 100) == 5e-4
    assert inv_sqrt_lr(100, 1e-3, 100) == 1e-3
    assert abs(inv_sqrt_lr(400, 1e-3, 100) - 5e-4) < 1e-12


def test_lr_schedule_placed_at_a_resumed_step_continues_the_uninterrupted_one():
    from student.train.trainer import TrainConfig, lr_schedule
    cfg = TrainConfig(out_dir="", lr=2e-3, warmup=4)

    def lrs(start, n):
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=123.0)  # a resumed optimiser's stale lr
        sched, out = lr_schedule(opt, cfg, start), []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out
    whole = lrs(0, 10)
    assert whole == [inv_sqrt_lr(s, 2e-3, 4) for s in range(1, 11)]  # step s runs at the schedule's value for s
    assert max(whole) == whole[3] == 2e-3
    assert lrs(6, 4) == whole[6:]


def _command_options(path: str, marker: str) -> dict:
    """The options of the first `.venv/bin/python -m student.train` command line of a markdown file."""
    import re
    import shlex
    from student.train.__main__ import train_parser
    text = open(os.path.join(ROOT, path)).read().replace("\\\n", " ")  # joins continued lines
    line = re.search(r"^\.venv/bin/python -m student\.train (.*)$", text, re.M)
    assert line and marker in line.group(0), path
    opts = vars(train_parser().parse_args(shlex.split(line.group(1))))
    del opts["out"]
    return opts


def _on_cpu(opts: dict) -> dict:
    """The options with the batch, lr and warm-up the trainer resolves on CPU (sizing.py)."""
    from student.train.trainer import TrainConfig, resolve_sizes
    cfg = TrainConfig(out_dir="", preset=opts["preset"], **{k: opts[k] for k in ("max_tokens", "max_sentences",
                                                                                  "lr", "warmup")})
    cfg, _ = resolve_sizes(cfg, torch.device("cpu"), opts["vocab_size"])
    return {**opts, **{k: getattr(cfg, k) for k in ("max_tokens", "max_sentences", "lr", "warmup")}}


def test_readme_teacher_command_is_the_measured_recipe_of_docs_training():
    readme = _command_options("README.md", "--preset teacher-tiny")
    measured = _command_options("docs/training.md", "--lr 2e-3")
    # that run said --amp off on an AVX2-only CPU, where the default auto is fp32 too
    assert measured.pop("amp") == "off" and readme.pop("amp") == "auto"
    assert _on_cpu(readme) == _on_cpu(measured)


def test_student_train_and_distill_share_one_set_of_training_defaults():
    from student.distill.pipeline import DistillConfig, train_config
    from student.train.__main__ import train_parser
    from student.train.trainer import resolve_sizes
    a = train_parser().parse_args(["--out", "x"])
    # None: the device's default, docs/training.md's recipe on CPU; bf16 only on native-bf16 CPUs
    assert (a.lr, a.warmup, a.max_tokens, a.amp) == (None, None, None, "auto")
    assert _on_cpu(vars(a))["lr"] == 2e-3
    want = (2e-3, 400, 3072, "auto")
    for role in ("teacher", "student"):
        tc = train_config(DistillConfig(), role, "teacher-tiny", "a.src", "a.tgt")
        tc, _ = resolve_sizes(tc, torch.device("cpu"), 8000)
        assert (tc.lr, tc.warmup, tc.max_tokens, tc.amp, tc.seed) == want + (a.seed,), role
    assert DistillConfig.from_preset("wmt").amp == "auto"  # the GPU preset: bf16 (fp16 on older GPUs)


def test_padding_does_not_change_encoder_output_of_real_tokens():
    torch.manual_seed(0)
    m = Transformer(ModelArgs(vocab_size=50, d_model=32, n_heads=4, ffn_dim=64, encoder_layers=2,
                              decoder_layers=1, dropout=0.0)).eval()
    a = torch.tensor([[5, 6, 7, 2]])
    b = torch.tensor([[5, 6, 7, 2, 1, 1]])
    ea, _ = m.encode(a)
    eb, _ = m.encode(b)
    torch.testing.assert_close(ea, eb[:, :4])


def test_averaging_two_checkpoints_gives_mean_weights(tmp_path):
    from student.train.average import average
    m = Transformer(ModelArgs(vocab_size=20, d_model=8, n_heads=2, ffn_dim=16, encoder_layers=1, decoder_layers=1))
    sd1 = {k: torch.full_like(v, 1.0) for k, v in m.state_dict().items()}
    sd2 = {k: torch.full_like(v, 3.0) for k, v in m.state_dict().items()}
    for i, sd in enumerate((sd1, sd2)):
        torch.save({"model": sd, "optimizer": {}, "step": i}, tmp_path / f"ckpt-{i}.pt")
    out = average([str(tmp_path / "ckpt-0.pt"), str(tmp_path / "ckpt-1.pt")], str(tmp_path / "avg.pt"))
    avg = torch.load(out, weights_only=True)["model"]
    assert all(torch.all(v == 2.0) for v in avg.values())


def test_ranks_wait_for_rank_0s_corpus_preparation_past_the_30_minute_default(monkeypatch):
    """Under torchrun rank 0 prepares the corpus while the others wait at a barrier:
    the process group's timeout must outlast a WMT-sized preparation."""
    import datetime

    import torch.distributed as dist

    from student.train import trainer
    joined = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(kw))
    assert trainer.init_distributed()[0] is True
    assert joined and joined[0]["timeout"] >= datetime.timedelta(hours=2)
