"""Unit behaviour of the trainer's parts: loss, batches, LR schedule, averaging."""
import numpy as np
import torch
import torch.nn.functional as F

from student.model import ModelArgs, Transformer
from student.train.batching import collate, make_batches, shard
from student.train.loss import label_smoothed_nll
from student.train.trainer import inv_sqrt_lr


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
