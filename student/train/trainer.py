"""The training loop: token-budget batches, label smoothing, inverse-sqrt warmup,
accumulation, bf16/fp16 autocast, dev BLEU with patience, atomic checkpoints,
exact resume, and DDP when launched by torchrun.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import glob
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import sentencepiece as spm
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from decoder import durable
from decoder.machine import cpu_info, has_native_bf16
from student import chart
from student.checkpoint import CheckpointError, newest_checkpoint
from student.data import indexed, normalise, prepare
from student.data.pipeline import file_digest
from student.model import Transformer, preset
from student.modeldir import checked_args
from student.train import sizing
from student.train.batching import collate, make_batches, shard
from student.train.evaluate import score, translate, translate_lean
from student.train.init import init_from_teacher
from student.train.loss import label_smoothed_nll


@dataclass
class TrainConfig:
    out_dir: str
    preset: str = "teacher-tiny"
    model_overrides: dict = field(default_factory=dict)
    # data: a prepared corpus (student.data) and optionally other training targets (distillation)
    corpus: str = "bible-en-es"
    src: str | None = None
    tgt: str | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    vocab_size: int = 8000
    train_src: str | None = None  # override the training pairs (e.g. a distilled corpus)
    train_tgt: str | None = None
    dev_src: str | None = None    # the user's own dev and test pairs (e.g. a newstest);
    dev_tgt: str | None = None    # default: the corpus' own (student.data)
    test_src: str | None = None
    test_tgt: str | None = None
    # optimisation: None = the device's default (sizing.py, resolved once when training starts):
    # on CPU the measured teacher-tiny recipe of docs/training.md (3,072 tokens, 256 sentences,
    # lr 2e-3, 400 warm-up steps); on CUDA a batch sized by free GPU memory, lr and warm-up scaled
    # to it. student.distill takes its teacher and student defaults from here
    max_tokens: int | None = None
    max_sentences: int | None = None
    accum: int = 1
    lr: float | None = None
    warmup: int | None = None
    betas: tuple = (0.9, 0.98)
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    # off | auto | bf16 | fp16. auto: bf16 autocast where the CPU has native bf16 (1.35x the
    # tokens/s of fp32 for teacher-tiny on an AVX512-BF16 EPYC, student/train/speed.py), fp32 on
    # other CPUs (docs/training.md's measured recipe); on CUDA bf16 where the GPU supports it,
    # else fp16 with a gradient scaler (sizing.amp_dtype_for)
    amp: str = "auto"
    seed: int = 1
    # stopping
    max_steps: int = 0        # 0 = no limit
    max_epochs: int = 0
    max_minutes: float = 0.0  # training time budget, survives resume
    patience: int = 0         # evaluations without dev BLEU gain; 0 = off
    # evaluation and checkpoints
    eval_every: int = 500
    dev_max: int = 0          # dev sentences for BLEU (0 = all)
    dev_decoder: str = "lean"  # dev BLEU with the lean decoder (same tokens, faster) or "reference"
    save_every: int = 100
    keep_last: int = 4        # step checkpoints kept for averaging
    test_at_end: bool = True
    init_from: str | None = None  # a teacher model dir the model starts from (student/train/init.py)


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX). Without it autocast emulates
    bf16: on an AVX2-only EPYC a forced bf16 teacher-tiny step took 57 s
    against 2.6 s in fp32, so `auto` keeps fp32 there."""
    return has_native_bf16(cpu_info()["flags"])


def dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def atomic_save(obj, path: str):
    # through Python's writes: a full disk is an OSError with its errno, not torch's "unexpected pos"
    durable.atomic_write(path, lambda tmp: durable.write_through(tmp, lambda fh: torch.save(obj, fh)))


def remove_stale_tmp(out_dir: str) -> list[str]:
    """Delete the half-written `X.tmp.PID` files of atomic_save whose process is
    gone (a run killed inside a save); returns their names."""
    return durable.remove_stale(out_dir)


def release_memory():
    """Hand freed heap back to the OS. Length-bucketed batches allocate tensors of
    ever-changing sizes and glibc's arenas fragment: measured on teacher-tiny,
    RSS grew 1.6 -> 5.4 GB in 20 minutes and fell back to 1.6 GB after a trim."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def inv_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


def lr_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> LambdaLR:
    """Linear warm-up then inverse square root, peaking at cfg.lr, positioned after
    `step` optimiser steps. Recomputed from the step on resume (no state of its
    own in the checkpoint), so a resumed run and an uninterrupted one agree."""
    for g in opt.param_groups:
        g["initial_lr"] = cfg.lr  # the peak of this run's config, not of a resumed optimiser state
    # LambdaLR's epoch e is the number of steps done; step e + 1 runs at this factor
    return LambdaLR(opt, lambda e: inv_sqrt_lr(e + 1, 1.0, cfg.warmup), last_epoch=step - 1)


def prepare_corpus(cfg: TrainConfig, verbose: bool):
    return prepare(cfg.corpus, src=cfg.src, tgt=cfg.tgt, src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang,
                   dev_src=cfg.dev_src, dev_tgt=cfg.dev_tgt, test_src=cfg.test_src, test_tgt=cfg.test_tgt,
                   vocab_size=cfg.vocab_size, verbose=verbose)


class Corpus:
    """The prepared corpus: train normalised and encoded into memory-mapped shards on disk
    (student/data/indexed.py, cached under the run dir), dev in memory."""

    def __init__(self, cfg: TrainConfig, verbose: bool, prep=None):
        self.prep = prep or prepare_corpus(cfg, verbose)
        self.sp = spm.SentencePieceProcessor(model_file=self.prep.spm_model)
        p = self.prep
        self.norm_src = lambda s: normalise(s, p.src_lang, p.normaliser)
        self.norm_tgt = lambda s: normalise(s, p.tgt_lang, p.normaliser)
        self.train = self._encode_train(cfg, verbose)
        self.dev_src, self.dev_ref = p.read("dev")
        self.dev = self._encode(cfg, "dev", self.dev_src, self.dev_ref)

    def _encode_train(self, cfg, verbose) -> indexed.Indexed:
        """The training pairs (cfg.train_src/tgt, e.g. a distilled corpus, else the prepared train
        split) encoded once, keyed by content; every rank encodes its shards."""
        p = self.prep
        src, tgt = (cfg.train_src, cfg.train_tgt) if cfg.train_src else p.splits["train"]
        key = hashlib.sha256(json.dumps([indexed.FORMAT, file_digest(src), file_digest(tgt),
                                         file_digest(p.spm_model), p.normaliser, p.src_lang, p.tgt_lang],
                                        sort_keys=True).encode()).hexdigest()[:16]
        rank, world = dist_info()
        return indexed.encode(src, tgt, p.spm_model, (p.src_lang, p.tgt_lang), p.normaliser,
                              os.path.join(cfg.out_dir, f"encoded-train-{key}"), rank, world, verbose,
                              barrier=lambda: dist.barrier() if world > 1 else None)

    def _encode(self, cfg, name, src, tgt):
        key = hashlib.sha256(("\n".join(src) + "\0" + "\n".join(tgt)).encode()).hexdigest()[:16]
        key += hashlib.sha256(open(self.prep.spm_model, "rb").read()).hexdigest()[:8]
        path = os.path.join(cfg.out_dir, f"encoded-{name}-{key}.pt")
        if os.path.exists(path):
            return torch.load(path, weights_only=True)
        eos = self.sp.eos_id()
        limit = 1022  # leaves room for eos under the presets' max_positions
        s_ids = [x[:limit] + [eos] for x in self.sp.encode([self.norm_src(s) for s in src])]
        t_ids = [x[:limit] + [eos] for x in self.sp.encode([self.norm_tgt(t) for t in tgt])]
        enc = {"src": s_ids, "tgt": t_ids}
        if dist_info()[0] == 0:
            atomic_save(enc, path)
        return enc


def build_model(cfg: TrainConfig, vocab_size: int) -> Transformer:
    args = preset(cfg.preset, vocab_size=vocab_size, **cfg.model_overrides)
    return Transformer(args)


def checkpoint_state(model, opt, scaler, state, cfg, meta) -> dict:
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "model_args": asdict(model.args), "config": _jsonable(asdict(cfg)), "meta": meta,
        "rng_torch": torch.get_rng_state(), "rng_python": random.getstate(),
        **state,
    }


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=list))


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) into cfg.out_dir; returns the final metrics."""
    ddp, device = init_distributed()
    os.makedirs(cfg.out_dir, exist_ok=True)
    t = Trainer(cfg, load_corpus(cfg, ddp), device, ddp)
    reason = t.fit()
    t.save([t.last_path])
    if not os.path.exists(t.best_path):
        t.save([t.best_path])
    result = t.summary(reason)
    dump = os.environ.get("KIT_DUMP_PARAMS_DIR")
    if dump:  # lets tests compare the replicas of a DDP run
        os.makedirs(dump, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in t.model.state_dict().items()},
                   os.path.join(dump, f"rank{t.rank}.pt"))
    if t.rank == 0 and cfg.test_at_end:
        result.update(t.test())  # loads best.pt into the model
    if t.rank == 0:
        durable.write_json(os.path.join(cfg.out_dir, "metrics.json"), result)  # last: the run's result
        chart.plot_dev_bleu({cfg.preset or "model": chart.curves_of(result)}, os.path.join(cfg.out_dir, chart.CHART),
                            title=f"{os.path.basename(os.path.abspath(cfg.out_dir))}: dev BLEU during training")
    if ddp:
        dist.barrier()
    return result


DIST_TIMEOUT = datetime.timedelta(hours=12)


def init_distributed() -> tuple[bool, torch.device]:
    """(DDP or not, this rank's device); joins the process group when torchrun launched us."""
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp and not dist.is_initialized():
        # rank 0 prepares the corpus while the others wait at a barrier (load_corpus): a WMT-sized
        # preparation outlasts the 30-minute default, as distillation's ranks do (distill/pipeline.py)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=DIST_TIMEOUT)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return ddp, device


def load_corpus(cfg: TrainConfig, ddp: bool) -> Corpus:
    rank = dist_info()[0]
    prep = prepare_corpus(cfg, True) if rank == 0 else None  # rank 0 prepares, the others read it
    if ddp:
        dist.barrier()
    return Corpus(cfg, rank == 0, prep or prepare_corpus(cfg, False))  # every rank encodes its shards


def autocast_setup(amp: str, device: torch.device):
    """(autocast dtype or None, GradScaler or None) for cfg.amp on this device."""
    cuda = device.type == "cuda"
    dtype, scaled = sizing.amp_dtype_for(amp, device.type, cpu_bf16=not cuda and cpu_has_bf16(),
                                         cuda_bf16=cuda and torch.cuda.is_bf16_supported())
    return dtype, torch.amp.GradScaler("cuda") if scaled else None


SIZE_FIELDS = ("max_tokens", "max_sentences", "lr", "warmup")


def resolve_sizes(cfg: TrainConfig, device: torch.device, vocab_size: int,
                  saved: dict | None = None) -> tuple[TrainConfig, str]:
    """cfg with its batch, lr and warm-up decided for this device (sizing.resolve), and the line
    saying how. A resumed run keeps the sizes it started with (`saved`, its sizes.json): its data
    position indexes batches of that size, whatever the GPU's free memory is now."""
    given = {k: getattr(cfg, k) for k in SIZE_FIELDS}
    if saved:
        given = {k: saved[k] if given[k] is None else given[k] for k in SIZE_FIELDS}
    free = None
    if device.type == "cuda":
        free = torch.tensor(torch.cuda.mem_get_info(device)[0], device=device)
        if dist.is_available() and dist.is_initialized():  # DDP ranks step in lockstep: one batch size
            dist.all_reduce(free, op=dist.ReduceOp.MIN)
        free = int(free)
    shape = sizing.Shape.of(preset(cfg.preset, vocab_size=vocab_size, **cfg.model_overrides))
    sz = sizing.resolve(device.type, free, shape, beta2=cfg.betas[1], **given)
    why = "sizes of the run being resumed" if saved else sz.why
    return replace(cfg, **{k: getattr(sz, k) for k in SIZE_FIELDS}), (
        f"batch: {why}; at most {sz.max_sentences} sentences; peak lr {sz.lr:.3g}, {sz.warmup} warm-up steps")


class Trainer:
    """One run's model, optimizer and progress (`state`, all of it in each checkpoint)."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus, device: torch.device, ddp: bool):
        self.rank, self.world = dist_info()
        self.verbose = self.rank == 0
        self.last_path = os.path.join(cfg.out_dir, "last.pt")
        cfg = self.decide_sizes(cfg, device, corpus.sp.get_piece_size())
        self.cfg, self.corpus, self.device, self.ddp = cfg, corpus, device, ddp
        src_lens, tgt_lens = corpus.train.lengths()  # (N,) int32 each: the corpus' only resident part
        self.train_lens = (src_lens, tgt_lens + 1)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        sp, prep = corpus.sp, corpus.prep
        self.model = build_model(cfg, sp.get_piece_size()).to(device)
        self.meta = {"spm_model": os.path.abspath(prep.spm_model), "src_lang": prep.src_lang,
                     "tgt_lang": prep.tgt_lang, "normaliser": prep.normaliser, "preset": cfg.preset,
                     "bos_id": sp.bos_id(), "unk_id": sp.unk_id(), "data_dir": prep.dir}
        self.amp_dtype, self.scaler = autocast_setup(cfg.amp, device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8,
                                    weight_decay=cfg.weight_decay)
        self.state = {"step": 0, "epoch": 0, "batch_idx": 0, "best_bleu": -1.0, "bad_evals": 0,
                      "train_seconds": 0.0, "tokens": 0, "history": [], "losses": []}
        self.best_path = os.path.join(cfg.out_dir, "best.pt")
        if self.rank == 0:
            for f in remove_stale_tmp(cfg.out_dir):
                print(f"removed {f}: a save cut short by an earlier run", flush=True)
        if not self.resume() and cfg.init_from:  # before step 0 only: a resumed run already holds its own weights
            self.initialise(cfg.init_from)
        self.schedule = lr_schedule(self.opt, cfg, self.state["step"])
        self.net = self.model
        if ddp:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def decide_sizes(self, cfg: TrainConfig, device: torch.device, vocab_size: int) -> TrainConfig:
        """cfg resolved by resolve_sizes, said in one line and kept in OUT/sizes.json for a resume."""
        path = os.path.join(cfg.out_dir, "sizes.json")
        resuming = os.path.exists(self.last_path) or glob.glob(os.path.join(cfg.out_dir, "ckpt-*.pt"))
        saved = _read_json(path) if resuming else None
        cfg, line = resolve_sizes(cfg, device, vocab_size, saved)
        if self.verbose:
            print(line, flush=True)
            if cfg.out_dir and os.path.isdir(cfg.out_dir):
                durable.write_json(path, {k: getattr(cfg, k) for k in SIZE_FIELDS})
        return cfg

    def resume(self) -> bool:
        """Load the newest checkpoint of the run dir that loads (checkpoint.newest_checkpoint), saying
        which were skipped and why; False when there is none, CheckpointError when none loads."""
        path, ck, skipped = newest_checkpoint(self.cfg.out_dir, self.resumable)
        for why in skipped if self.verbose else ():
            print(f"warning: not resuming from {why}", file=sys.stderr, flush=True)
        if path is None and skipped:
            raise CheckpointError(f"{self.cfg.out_dir}: no checkpoint to resume from loads ({len(skipped)} "
                                  f"tried, above); move them out of the run dir to start afresh")
        if path is None:
            return False
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        if self.scaler is not None and ck.get("scaler"):
            self.scaler.load_state_dict(ck["scaler"])
        torch.set_rng_state(ck["rng_torch"])
        random.setstate(_to_tuple(ck["rng_python"]))
        for k in self.state:
            self.state[k] = ck[k]
        if self.verbose:
            st = self.state
            print(f"resuming from {path} at step {st['step']} (epoch {st['epoch']}, "
                  f"batch {st['batch_idx']})", flush=True)
        return True

    def resumable(self, ck: dict, path: str) -> None:
        """CheckpointError unless `ck` is a checkpoint of this run's model that a run resumes from."""
        missing = [k for k in (*self.state, "optimizer", "rng_torch", "rng_python") if k not in ck]
        if missing:
            raise CheckpointError(f"{path}: not a checkpoint to resume from (no {missing[0]!r})")
        if not isinstance(ck["step"], int) or isinstance(ck["step"], bool):
            raise CheckpointError(f"{path}: not a checkpoint to resume from (its step is not an integer)")
        if not isinstance(ck["optimizer"], dict):  # an average (student.train average) has none
            raise CheckpointError(f"{path}: not a checkpoint to resume from (no optimizer state: an average?)")
        mine = self.model.args.arch_dict()
        theirs = checked_args(ck["model_args"], path).arch_dict()
        differ = [f"{k} {theirs[k]}, not {mine[k]}" for k in mine if theirs[k] != mine[k]]
        if differ:
            raise CheckpointError(f"{path}: a checkpoint of another model ({', '.join(differ)})")

    def initialise(self, model_dir: str):
        p = init_from_teacher(self.model, model_dir, spm_model=self.corpus.prep.spm_model)
        if self.verbose:
            print(f"initialised from {model_dir}: {p.describe()}", flush=True)

    def save(self, paths: list[str]):
        if self.rank != 0:
            return
        ck = checkpoint_state(self.model, self.opt, self.scaler, self.state, self.cfg, self.meta)
        for p in paths:
            atomic_save(ck, p)

    def save_step(self, also: list[str] = ()):
        """A step checkpoint ckpt-STEP.pt (and the files in `also`), keeping the last cfg.keep_last:
        at each evaluation and every save_every steps, so that averages of recent steps
        (average.py) never leave out the steps since the last evaluation."""
        if self.rank != 0:
            return
        self.save([*also, os.path.join(self.cfg.out_dir, f"ckpt-{self.state['step']:07d}.pt")])
        _prune_step_checkpoints(self.cfg.out_dir, self.cfg.keep_last)

    def stop_reason(self) -> str | None:
        cfg, st = self.cfg, self.state
        if cfg.max_steps and st["step"] >= cfg.max_steps:
            return "max_steps"
        if cfg.max_epochs and st["epoch"] >= cfg.max_epochs:
            return "max_epochs"
        if cfg.max_minutes and st["train_seconds"] >= cfg.max_minutes * 60:
            return "max_minutes"
        if cfg.patience and st["bad_evals"] >= cfg.patience:
            return "patience"
        return None

    def fit(self) -> str:
        """Train until a stop condition holds; returns its name."""
        self.model.train()
        self.bar = tqdm(total=self.cfg.max_steps or None, initial=self.state["step"], disable=not self.verbose,
                        dynamic_ncols=True, desc=f"train {self.cfg.preset}")
        reason = self.stop_reason()
        self.t_last, self.tok_window, self.t_window = time.time(), 0, time.time()
        while reason is None:
            reason = self.epoch()
        self.bar.close()
        return reason

    def epoch(self) -> str | None:
        """The rest of the current epoch, or less if a stop condition comes first."""
        cfg, st = self.cfg, self.state
        batches = shard(make_batches(*self.train_lens, cfg.max_tokens, cfg.max_sentences, cfg.seed, st["epoch"]),
                        self.rank, self.world)
        reason = None
        while st["batch_idx"] < len(batches) and reason is None:
            group = batches[st["batch_idx"]: st["batch_idx"] + cfg.accum]
            ntok, loss, lr = self.step(group)
            self.account(len(group), ntok, loss, lr)
            epoch_done = st["batch_idx"] >= len(batches)
            if epoch_done:
                st["epoch"] += 1
                st["batch_idx"] = 0
            if cfg.eval_every and st["step"] % cfg.eval_every == 0:
                self.evaluate()
            if cfg.save_every and st["step"] % cfg.save_every == 0:
                self.save_step(also=[self.last_path])
            if st["step"] % 50 == 0:
                release_memory()
            reason = self.stop_reason()
            if epoch_done:
                break  # the next epoch has its own batches
        return reason

    def step(self, group: list) -> tuple[int, float, float]:
        """One optimizer step over the micro-batches in `group`; (target tokens, loss, lr)."""
        lr = self.schedule.get_last_lr()[0]
        ntok, loss = self.backward(group)
        self.update()
        return ntok, loss, lr

    def backward(self, group: list) -> tuple[int, float]:
        """The gradients of `group` (under DDP, all-reduced at its last micro-batch), the loss
        normalised by the group's target tokens; (target tokens, loss)."""
        a, cfg, scaler = self.model.args, self.cfg, self.scaler
        src_ids, tgt_ids = self.corpus.train["src"], self.corpus.train["tgt"]
        micro = [collate(src_ids, tgt_ids, idx, a.pad_id, a.decoder_start_id, a.eos_id) for idx in group]
        ntok = sum(int((to != a.pad_id).sum()) for _, _, to in micro)
        loss_total = 0.0
        for k, batch in enumerate(micro):
            s, ti, to = (t.to(self.device) for t in batch)
            sync = k == len(micro) - 1
            with self.net.no_sync() if (self.ddp and not sync) else contextlib.nullcontext():
                with self.autocast():
                    logits = self.net(s, ti)
                loss, _, _ = label_smoothed_nll(logits, to, cfg.label_smoothing, a.pad_id)
                loss = loss / ntok
                (scaler.scale(loss) if scaler else loss).backward()
            loss_total += loss.item()
        return ntok, loss_total

    def update(self) -> None:
        """The optimizer and schedule step on the gradients backward() left."""
        cfg, opt, scaler = self.cfg, self.opt, self.scaler
        if scaler:
            scaler.unscale_(opt)
        if cfg.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        self.schedule.step()
        opt.zero_grad(set_to_none=True)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def account(self, n_batches: int, ntok: int, loss: float, lr: float):
        """Progress after a step: the state's counters, the training clock, the progress bar."""
        st, now = self.state, time.time()
        st["train_seconds"] += now - self.t_last
        self.t_last = now
        st["step"] += 1
        st["batch_idx"] += n_batches
        st["tokens"] += ntok * self.world
        st["losses"].append(round(loss, 4))
        self.tok_window += ntok * self.world
        self.bar.update(1)
        if now - self.t_window > 2:
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}",
                                 tok_s=f"{self.tok_window / (now - self.t_window):.0f}", ep=st["epoch"])
            self.tok_window, self.t_window = 0, now

    def evaluate(self):
        """Dev metrics into the history, patience, best.pt and a step checkpoint (rank 0);
        the ranks then agree on patience."""
        st = self.state
        m = self.dev_metrics() if self.rank == 0 else {}
        m["step"], m["epoch"] = st["step"], st["epoch"]
        m["minutes"] = round(st["train_seconds"] / 60, 2)
        if self.rank == 0:
            improved = m["dev_bleu"] > st["best_bleu"]
            if improved:
                st["best_bleu"], st["bad_evals"] = m["dev_bleu"], 0
            else:
                st["bad_evals"] += 1
            st["history"].append(m)
            tqdm.write(f"step {m['step']}  dev loss {m['dev_loss']:.3f}  BLEU {m['dev_bleu']:.2f}  "
                       f"chrF {m['dev_chrf']:.2f}  ({m['minutes']} min){'  *best*' if improved else ''}")
            self.save([self.best_path] if improved else [])
            self.save_step()
        if self.ddp:
            obj = [st["bad_evals"], st["best_bleu"]]
            dist.broadcast_object_list(obj, src=0)
            st["bad_evals"], st["best_bleu"] = obj
        release_memory()
        self.t_last = time.time()  # evaluation is not training time

    def dev_metrics(self) -> dict:
        c = self.corpus
        self.model.eval()
        loss = self.dev_loss()
        n_dev = self.cfg.dev_max or len(c.dev_src)
        m = score(self.decode(c.dev_src[:n_dev]), c.dev_ref[:n_dev])
        self.model.train()
        return {"dev_loss": loss, "dev_bleu": m["bleu"], "dev_chrf": m["chrf"]}

    @torch.no_grad()
    def dev_loss(self) -> float:
        """Per-token dev cross-entropy (no label smoothing)."""
        a, dev = self.model.args, self.corpus.dev
        loss_sum, ntok = 0.0, 0
        for idx in make_batches([len(x) for x in dev["src"]], [len(x) + 1 for x in dev["tgt"]],
                                self.cfg.max_tokens, self.cfg.max_sentences, 0, 0, shuffle=False):
            s, ti, to = (t.to(self.device) for t in collate(dev["src"], dev["tgt"], idx, a.pad_id,
                                                            a.decoder_start_id, a.eos_id))
            with self.autocast():
                logits = self.model(s, ti)
            _, nll, n = label_smoothed_nll(logits, to, 0.0, a.pad_id)
            loss_sum, ntok = loss_sum + nll.item(), ntok + n
        return round(loss_sum / max(ntok, 1), 4)

    def decode(self, lines: list[str]) -> list[str]:
        """Greedy translations for dev and test BLEU, with the decoder cfg.dev_decoder names."""
        if self.cfg.dev_decoder == "lean":
            return translate_lean(self.model, self.meta, lines, self.cfg.out_dir)
        return translate(self.model, self.corpus.sp, lines, self.corpus.norm_src, amp_dtype=self.amp_dtype)

    def summary(self, reason: str) -> dict:
        st = self.state
        return {"stop_reason": reason, "step": st["step"], "epoch": st["epoch"],
                "dev_set": self.corpus.prep.held_out.get("dev"), "test_set": self.corpus.prep.held_out.get("test"),
                "train_minutes": round(st["train_seconds"] / 60, 2), "best_dev_bleu": st["best_bleu"],
                "history": st["history"], "train_loss": st["losses"]}

    def test(self) -> dict:
        """The best checkpoint on the test split; writes test.hyp."""
        ck = torch.load(self.best_path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(ck["model"])
        prep = self.corpus.prep
        tsrc, tref = prep.read("test")
        t0 = time.time()
        hyps = self.decode(tsrc)
        m = score(hyps, tref)
        out = {"test_" + k: v for k, v in m.items()}
        out["test_translate_seconds"] = round(time.time() - t0, 1)
        out["best_step"] = ck["step"]
        durable.write_lines(os.path.join(self.cfg.out_dir, "test.hyp"), hyps)
        print(f"test ({prep.src_lang}->{prep.tgt_lang}, best step {ck['step']}): "
              f"BLEU {m['bleu']:.2f}  chrF {m['chrf']:.2f}", flush=True)
        return out


def _prune_step_checkpoints(out_dir: str, keep: int):
    cks = sorted(f for f in os.listdir(out_dir) if f.startswith("ckpt-") and f.endswith(".pt"))
    for f in cks[:-keep] if keep else cks:
        os.remove(os.path.join(out_dir, f))


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _to_tuple(x):
    return tuple(_to_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x
