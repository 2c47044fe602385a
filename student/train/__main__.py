"""python -m student.train [--preset P] --out DIR ...   (torchrun-aware)
python -m student.train average --run DIR --last N --out FILE
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys

from decoder import cliargs, durable, fileerrors
from decoder.cliargs import (HelpFormatter, float_range, int_range, nonneg_float, nonneg_int, positive_float,
                             positive_int)
from decoder.modeldir import MAX_VOCAB, ModelDirError
from student.checkpoint import CheckpointError
from student.data import DataError
from student.model import PRESETS
from student.train import sizing
from student.train.average import average, last_checkpoints
from student.train.init import InitError
from student.train.trainer import TrainConfig, train


def train_parser() -> argparse.ArgumentParser:
    d = TrainConfig(out_dir="")
    p = cliargs.ArgumentParser(
        prog="python -m student.train", formatter_class=HelpFormatter,
        description="Train a Transformer (teacher or student) on a prepared corpus. Rerunning the same "
                    "command resumes from OUT/last.pt. Launch with torchrun for DDP "
                    "(gloo on CPU, NCCL on GPU). Subcommand: 'average' (checkpoint averaging).")
    cliargs.add_version(p)
    p.add_argument("--out", required=True, help="run dir: checkpoints, metrics.json, test.hyp")
    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model field, e.g. --set dropout=0.2 (repeatable)")
    _data_options(p.add_argument_group("data"), d)
    _optimisation_options(p.add_argument_group("optimisation"), d)
    _stopping_options(p.add_argument_group("stopping, evaluation, checkpoints"), d)
    p.add_argument("--init-from", metavar="MODEL_DIR",
                   help="start from this teacher model dir (its embeddings, encoder, decoder layers and final "
                        "norms; shrink-and-fine-tune, docs/distill.md) instead of random weights; a resumed "
                        "run keeps its own (default: random)")
    return p


def _data_options(g, d: TrainConfig) -> None:
    g.add_argument("--corpus", default=d.corpus, help="embedded corpus name (default %(default)s)")
    g.add_argument("--src", help="user source file (plain or .gz) instead of the embedded corpus")
    g.add_argument("--tgt", help="user target file, same line count as --src")
    g.add_argument("--src-lang"); g.add_argument("--tgt-lang")
    g.add_argument("--vocab-size", type=int_range(1, MAX_VOCAB), default=d.vocab_size)
    g.add_argument("--train-src", help="train on these pairs instead of the corpus' train split "
                                       "(e.g. a distilled corpus); dev/test stay the corpus'")
    g.add_argument("--train-tgt")
    for split, default in (("dev", "the corpus' dev split"), ("test", "the corpus' test split")):
        g.add_argument(f"--{split}-src", help=f"your own {split} source file, e.g. a newstest (default: {default})")
        g.add_argument(f"--{split}-tgt", help="its reference translations, same line count")


def _optimisation_options(g, d: TrainConfig) -> None:
    cliargs.alias(g, "--max-tokens", g.add_argument(
        "--max-batch-tokens", dest="max_tokens", metavar="N", type=positive_int, default=d.max_tokens,
        help=f"padded tokens per batch (default: the device's: {sizing.REF_TOKENS} on CPU; on CUDA sized by "
             f"free GPU memory, {sizing.GPU_FLOOR_TOKENS}-{sizing.GPU_CEILING_TOKENS}; docs/training.md)"))
    cliargs.alias(g, "--max-sentences", g.add_argument(
        "--batch-size", dest="max_sentences", metavar="N", type=positive_int, default=d.max_sentences,
        help=f"sentences per batch, at most (default: {sizing.REF_SENTENCES} on CPU, tokens / "
             f"{sizing.MIN_TOKENS_PER_SENTENCE} on CUDA)"))
    g.add_argument("--accum", type=positive_int, default=d.accum, help="batches per optimiser step")
    g.add_argument("--lr", type=positive_float, default=d.lr,
                   help=f"peak learning rate (default: {sizing.REF_LR:g} at {sizing.REF_TOKENS} tokens a batch or "
                        f"fewer, times sqrt(batch / {sizing.REF_TOKENS}) above, at most {sizing.LR_SCALE_CAP:g}x)")
    g.add_argument("--warmup", type=positive_int, default=d.warmup,
                   help=f"warm-up steps (default: {sizing.REF_WARMUP} at {sizing.REF_TOKENS} tokens a batch or fewer; "
                        f"above, the same {sizing.REF_WARMUP * sizing.REF_TOKENS:,} tokens, at least 100 steps)")
    g.add_argument("--label-smoothing", type=float_range(0.0, 1.0), default=d.label_smoothing)
    g.add_argument("--clip-norm", type=nonneg_float, default=d.clip_norm)
    g.add_argument("--amp", default=d.amp, choices=["auto", "bf16", "fp16", "off"],
                   help="auto: bf16 on CPUs with AVX512-BF16/AMX and on GPUs with bf16, fp16 (loss-scaled) on "
                        "older GPUs, else fp32; weights and optimiser stay fp32")
    g.add_argument("--seed", type=nonneg_int, default=d.seed)


def _stopping_options(g, d: TrainConfig) -> None:
    g.add_argument("--max-steps", type=nonneg_int, default=0)
    g.add_argument("--max-epochs", type=nonneg_int, default=0)
    g.add_argument("--max-minutes", type=nonneg_float, default=0.0, help="training-time budget (kept across resume)")
    g.add_argument("--patience", type=nonneg_int, default=0, help="stop after N evaluations without dev BLEU gain")
    g.add_argument("--eval-every", type=nonneg_int, default=d.eval_every)
    g.add_argument("--dev-max", type=nonneg_int, default=0, help="dev sentences used for BLEU (0 = all)")
    g.add_argument("--dev-decoder", default=d.dev_decoder, choices=["lean", "reference"],
                   help="dev BLEU with the lean decoder (default; same tokens, faster) or the training model's "
                        "plain greedy")
    g.add_argument("--save-every", type=nonneg_int, default=d.save_every,
                   help="steps between checkpoints: last.pt (resume) and a step checkpoint ckpt-STEP.pt")
    g.add_argument("--keep-last", type=nonneg_int, default=d.keep_last)
    g.add_argument("--no-test", action="store_true", help="skip the test-split BLEU at the end")


def _value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def average_parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="python -m student.train average", formatter_class=HelpFormatter,
                               description="Average the weights of the last N step checkpoints of a run.")
    cliargs.add_version(p)
    p.add_argument("--run", required=True, metavar="DIR", help="run dir of student.train (holds ckpt-*.pt)")
    p.add_argument("--last", type=positive_int, default=4, metavar="N",
                   help="how many of the latest step checkpoints; a run with fewer (--keep-last, a short run) "
                        "averages those it has and says so")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="checkpoint file to write (export it with student.export)")
    return p


def average_main(argv) -> int:
    a = average_parser().parse_args(argv)
    try:
        paths = last_checkpoints(a.run, a.last)
        if len(paths) < a.last:  # --keep-last or a short run left fewer: say so, average what is there
            print(f"note: {a.run} has {len(paths)} step checkpoint{'s' * (len(paths) != 1)}, not {a.last}; "
                  f"averaging {', '.join(os.path.basename(x) for x in paths)}", file=sys.stderr)
        out = average(paths, a.out)
    except ValueError as e:  # CheckpointError; a failing disk is main's one line (fileerrors)
        return _error(e)
    print(out)
    return 0


def _error(e) -> int:
    """Bad input: one line on stderr and exit 2, as every command of the kit."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def options(argv) -> argparse.Namespace:
    """The parsed options, checked against what the run can do before any work (file pairs
    and their line counts, the model --set asks for, --init-from, --out); a bad one is one
    `error:` line and exit 2 (SystemExit), as argparse's own errors."""
    a = train_parser().parse_args(argv)
    try:
        a.overrides = model_overrides(a.set, a.preset, a.vocab_size)
        check_files(a)
        if a.init_from and (why := cliargs.model_dir_error("--init-from", a.init_from, shortlist=False)):
            raise ValueError(why)  # the full check (weights) comes with the student
        if why := cliargs.out_dir_error("--out", a.out):
            raise ValueError(why)
    except (ValueError, ModelDirError, DataError, OSError, EOFError) as e:
        cliargs.refuse(e)
    return a


PAIRS = (("--src", "--tgt"), ("--train-src", "--train-tgt"), ("--dev-src", "--dev-tgt"), ("--test-src", "--test-tgt"))


def check_files(a) -> None:
    """Each file pair given whole, readable, with one line count (counted streaming, so a
    mismatch is refused in seconds, not after the corpus is prepared)."""
    from decoder.textio import count_lines
    given = {o: getattr(a, o[2:].replace("-", "_")) for pair in PAIRS for o in pair}
    if any(bool(given[s]) != bool(given[t]) for s, t in PAIRS):
        raise ValueError("--src/--tgt, --train-src/--train-tgt, --dev-src/--dev-tgt and --test-src/--test-tgt "
                         "come in pairs")
    for s, t in PAIRS:
        if not given[s]:
            continue
        counts = []
        for o in (s, t):
            if not os.path.isfile(given[o]):
                raise DataError(f"{o} {given[o]}: {'is a directory' if os.path.isdir(given[o]) else 'no such file'}")
            try:
                counts.append(count_lines(given[o]))
            except (OSError, EOFError) as e:  # gzip raises EOFError for a file cut short
                raise DataError(f"{o} {given[o]}: unreadable ({e})") from None
        if counts[0] != counts[1]:
            raise DataError(f"{s} {given[s]} has {counts[0]:,} lines but {t} {given[t]} has {counts[1]:,}: "
                            f"the pairs must be line-aligned")


def model_overrides(items: list[str], preset_name: str, vocab_size: int) -> dict:
    """--set KEY=VALUE as a dict, refused unless the model it gives is one the decoder
    loads (decoder/modeldir.py's schema: the sizes and their upper bounds) and its
    dropouts are probabilities: a typo must not cost a corpus preparation."""
    out = {}
    for kv in items:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {kv!r}")
        out[k] = _value(v)
    check_model(preset_name, {"vocab_size": vocab_size, **out}, "--set")
    return out


def check_model(preset_name: str, fields: dict, option: str) -> None:
    """ValueError unless `fields` over the preset make a model the decoder can load."""
    from student.model import PRESETS as MODELS
    from student.modeldir import checked_args
    checked_args(fields, option, MODELS[preset_name])


@fileerrors.one_line
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["average"]:
        return average_main(argv[1:])
    try:
        a = options(argv)
    except cliargs.Refused:
        return 2
    overrides = a.overrides
    cfg = TrainConfig(out_dir=a.out, preset=a.preset, model_overrides=overrides, corpus=a.corpus,
                      src=a.src, tgt=a.tgt, src_lang=a.src_lang, tgt_lang=a.tgt_lang,
                      vocab_size=a.vocab_size, train_src=a.train_src, train_tgt=a.train_tgt,
                      dev_src=a.dev_src, dev_tgt=a.dev_tgt, test_src=a.test_src, test_tgt=a.test_tgt,
                      max_tokens=a.max_tokens, max_sentences=a.max_sentences, accum=a.accum, lr=a.lr,
                      warmup=a.warmup, label_smoothing=a.label_smoothing, clip_norm=a.clip_norm,
                      amp=a.amp, seed=a.seed, max_steps=a.max_steps, max_epochs=a.max_epochs,
                      max_minutes=a.max_minutes, patience=a.patience, eval_every=a.eval_every,
                      dev_max=a.dev_max, dev_decoder=a.dev_decoder, save_every=a.save_every, keep_last=a.keep_last,
                      test_at_end=not a.no_test, init_from=a.init_from)
    created = not os.path.exists(a.out)
    try:
        with run_lock(a.out):
            result = train(cfg)
    except (DataError, FileNotFoundError, InitError, CheckpointError) as e:
        return _error(f"{e}{tidy_out(a.out, created)}")
    except BaseException:
        tidy_out(a.out, created)
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        print(final_words(cfg.out_dir, result), flush=True)
    return 0


def run_lock(out: str):
    """The run dir held by this run while it writes (rank 0 of a DDP run holds it for all):
    a second run on it is one line naming this one's pid, not two runs' checkpoints mixed."""
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    return durable.locked(out, "run dir")


def tidy_out(out: str, created: bool) -> str:
    """After a failed run: the --out this run created is removed if it is still empty;
    otherwise what it holds, in words for the error line (a rerun resumes from it)."""
    if not created or not os.path.isdir(out):
        return ""
    try:
        left = os.listdir(out)
        if not left:
            os.rmdir(out)
            return ""
    except OSError:  # another rank removed it first, or it is not ours to remove
        return ""
    return f" ({out} keeps {len(left)} file{'s' * (len(left) != 1)} of this run: the same command resumes)"


def final_words(out: str, m: dict) -> str:
    """Where the run went, its scores, and what to run next."""
    import glob
    q = shlex.quote
    steps = sorted(glob.glob(os.path.join(out, "ckpt-*.pt")))
    lines = [f"done ({m['stop_reason']} at step {m['step']}, {m['train_minutes']} training minutes)",
             f"checkpoints: {os.path.join(out, 'best.pt')} ("
             + (f"best dev BLEU {m['best_dev_bleu']:.2f}" if m["best_dev_bleu"] >= 0 else "no dev evaluation ran")
             + "), "
             f"{os.path.join(out, 'last.pt')} (resume), {len(steps)} step checkpoint(s) ckpt-*.pt",
             f"metrics: {os.path.join(out, 'metrics.json')}"
             + (f"; dev set: {m['dev_set']}" if m.get("dev_set") else "")]
    if "test_bleu" in m:
        lines += [f"test BLEU {m['test_bleu']:.2f}  chrF {m['test_chrf']:.2f} (best.pt, step {m['best_step']}; "
                  f"hypotheses in {os.path.join(out, 'test.hyp')}"
                  + (f"; test set: {m['test_set']})" if m.get("test_set") else ")"),
                  f"sacreBLEU: {m['test_bleu_signature']}"]
    model = os.path.join(out, "model")
    if len(steps) >= 2:
        avg = os.path.join(out, "averaged.pt")
        lines += ["next: average the last checkpoints and write the model dir (none is written yet):",
                  f"  python -m student.train average --run {q(out)} --last {len(steps)} --out {q(avg)}",
                  f"  python -m student.export {q(avg)} {q(model)}"]
    else:
        lines += ["next: write the model dir (none is written yet):",
                  f"  python -m student.export {q(os.path.join(out, 'best.pt'))} {q(model)}"]
    lines.append(f"  python -m decoder --model {q(model)} -i input.txt -o output.txt")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(cliargs.run(main))
