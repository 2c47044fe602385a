"""Ablation benchmark: naive PyTorch -> each optimisation in turn -> HF and CTranslate2
on the same weights (TenTrans-style table), plus a batch-1 latency comparison.

    python -m decoder.bench --model DIR [--input FILE --ref FILE] [--repeat K] [--threads N]

Every row translates the same lines end to end (normalise, SPM, search, detokenise)
with the same thread count; CTranslate2's CPU ISA is pinned (CT2_FORCE_CPU_ISA)
so runs compare. Writes docs/bench/<name>.md and .json with the machine described.
A model dir with a lexical shortlist (python -m student.shortlist) adds the
"+ lexical shortlist" rows, greedy and beam 4, beside the same rows without it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(ROOT, "tests", "fixtures", "bible-tiny")
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_info() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def ct2_isa(flags: list[str]) -> str:
    return "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "GENERIC"


def read(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return [line.rstrip("\r\n") for line in fh]


def scores(hyps, refs) -> tuple[float, float]:
    import sacrebleu
    return (round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
            round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2))


# -- engines: each returns (hypotheses, seconds) for the whole input ------------------------

def run_ours(model_dir, lines, threads, passes: int = 1, **kw):
    """(outputs, seconds): the fastest of `passes` timed passes after a warm-up."""
    from .translator import Translator
    tr = Translator(model_dir, threads=threads, **kw)
    tr.translate(lines[:8])  # warm-up: allocator, oneDNN primitive caches
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        out = tr.translate(lines)
        best = min(best, time.perf_counter() - t)
    return out, best


def _text(model_dir):
    from . import modeldir
    from .pipeline import Text
    cfg, _, spm_path = modeldir.load(model_dir)
    return cfg, Text(cfg, spm_path, cfg.arch.max_positions)


def ct2_translator(ct2_dir, model_dir, threads, compute_type, beam=1, max_tokens=4096, batch1=False,
                   device="cpu"):
    """Load once; return translate(lines) -> hypotheses (submission/evaluate times the two apart)."""
    import ctranslate2
    cfg, text = _text(model_dir)
    tr = ctranslate2.Translator(ct2_dir, device=device, compute_type=compute_type,
                                intra_threads=threads, inter_threads=1)
    piece = text.sp.id_to_piece

    def go(ls):
        srcs = text.encode(ls)
        idx = [i for i, s in enumerate(srcs) if s]
        toks = [[piece(t) for t in srcs[i]] for i in idx]
        cap = int(max(len(t) for t in toks) * 1.5 + 10) if toks else 1
        kw = dict(beam_size=beam, max_decoding_length=min(cap, cfg.arch.max_positions - 1),
                  min_decoding_length=0, max_input_length=cfg.arch.max_positions)
        if batch1:
            res = [tr.translate_batch([t], **kw)[0] for t in toks]
        else:
            res = tr.translate_batch(toks, max_batch_size=max_tokens, batch_type="tokens", **kw)
        out = [""] * len(ls)
        dec = text.decode([[text.sp.piece_to_id(p) for p in r.hypotheses[0]] for r in res])
        for i, s in zip(idx, dec):
            out[i] = s
        return out
    return go


def run_ct2(ct2_dir, model_dir, lines, threads, compute_type, beam=1, max_tokens=4096, batch1=False):
    go = ct2_translator(ct2_dir, model_dir, threads, compute_type, beam, max_tokens, batch1)
    go(lines[:8])
    t = time.perf_counter()
    out = go(lines)
    return out, time.perf_counter() - t


def hf_translator(model_dir, threads, batch=64, beam=1):
    """Load once; return translate(lines) -> hypotheses."""
    import torch
    from .convert import to_hf
    torch.set_num_threads(threads)
    model, cfg = to_hf(model_dir)
    _, text = _text(model_dir)

    def go(ls):
        srcs = text.encode(ls)
        idx = sorted((i for i, s in enumerate(srcs) if s), key=lambda i: -len(srcs[i]))
        out = [""] * len(ls)
        for b in range(0, len(idx), batch):
            chunk = idx[b:b + batch]
            S = max(len(srcs[i]) for i in chunk)
            ids = torch.full((len(chunk), S), cfg.pad_id)
            for r, i in enumerate(chunk):
                ids[r, :len(srcs[i])] = torch.tensor(srcs[i])
            with torch.inference_mode():
                g = model.generate(ids, attention_mask=ids != cfg.pad_id, num_beams=beam, do_sample=False,
                                   max_new_tokens=min(int(S * 1.5 + 10), cfg.arch.max_positions - 1),
                                   min_length=0, decoder_start_token_id=cfg.decoder_start_id,
                                   eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id)
            hyps = []
            for row in g[:, 1:].tolist():
                row = row[:row.index(cfg.eos_id)] if cfg.eos_id in row else row
                hyps.append([t for t in row if t != cfg.pad_id])
            for i, s in zip(chunk, text.decode(hyps)):
                out[i] = s
        return out
    return go


def run_hf(model_dir, lines, threads, batch=64):
    go = hf_translator(model_dir, threads, batch)
    go(lines[:8])
    t = time.perf_counter()
    out = go(lines)
    return out, time.perf_counter() - t


# -- the table -------------------------------------------------------------------------------

NAIVE = dict(beam=4, cache=False, sort=False, early_stop=False, softmax_free=False, fused_qkv=False,
             pipeline=False, precision="fp32", fused_ops=False, retain_memory=False, fused_cache=False,
             fused_argmax=False, fused_project_argmax=False, fused_topk=False, fused_log_softmax=False)


def ablation() -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(cumulative fp32 rows, precision rows). Each cumulative row adds one
    optimisation to the previous one; each precision row is the last fp32 row
    with one precision change, so the table shows what int8 or bf16 does on this
    CPU (on an AVX2-only CPU both are slower than fp32) and the best
    configuration is picked by measurement, not assumed."""
    steps = [("naive PyTorch (beam 4, no cache, unsorted, fp32)", {}),
             ("+ K/V cache, cross K/V once per sentence", dict(cache=True)),
             ("+ length-sorted batches", dict(sort=True)),
             ("+ greedy without softmax", dict(beam=1, softmax_free=True)),
             ("+ early stop (finished sentences leave)", dict(early_stop=True)),
             ("+ fused QKV", dict(fused_qkv=True)),
             ("+ async text pipeline", dict(pipeline=True)),
             # process-wide and irreversible: every row after this one has it too
             ("+ glibc keeps freed memory", dict(retain_memory=True))]
    rows, cur = [], dict(NAIVE)
    for name, change in steps:
        cur = {**cur, **change}
        rows.append((name, dict(cur)))
    variants = [("+ bf16 weights and activations", {**cur, "precision": "bf16"}),
                ("+ int8 dynamic (PyTorch ops)", {**cur, "precision": "int8"}),
                ("+ int8 dynamic, fused C++ linear", {**cur, "precision": "int8", "fused_ops": True}),
                ("+ fused bias+residual+LayerNorm (C++)", {**cur, "fused_norm": True}),
                ("+ fused bias+relu (C++)", {**cur, "fused_relu": True}),
                ("+ fused decode-step attention (C++)", {**cur, "fused_attention": True}),
                ("+ fused q/k/v split into the K/V cache (C++)", {**cur, "fused_cache": True}),
                ("+ all fused kernels (norm, relu, attention, cache)", {**cur, "fused_norm": True, "fused_relu": True,
                                                                        "fused_attention": True, "fused_cache": True}),
                ("+ fused argmax (C++)", {**cur, "fused_argmax": True}),
                ("+ fused output projection + argmax (C++)", {**cur, "fused_project_argmax": True})]
    return rows, variants


def describe(kw: dict) -> str:
    """Short name of a picked configuration: its precision and fused kernels."""
    parts = [kw["precision"] + (", fused linear" if kw["precision"] == "int8" and kw["fused_ops"] else "")]
    parts += [n for k, n in (("fused_norm", "fused norm"), ("fused_relu", "fused relu"),
                             ("fused_attention", "fused attention"), ("fused_cache", "fused cache"),
                             ("fused_argmax", "fused argmax"), ("fused_project_argmax", "fused projection+argmax"))
              if kw.get(k)]
    return ", ".join(parts)


def pick_best(rows: list[tuple[float, float | None, dict]], max_bleu_loss: float = 0.2) -> dict:
    """The fastest of (words/s, BLEU, config) greedy rows that stays within
    `max_bleu_loss` BLEU of the best-optimised fp32 row (the last fp32 one)."""
    fp32 = [b for _, b, kw in rows if kw["precision"] == "fp32" and b is not None]
    ok = [r for r in rows if not fp32 or r[1] is None or r[1] >= fp32[-1] - max_bleu_loss]
    return max(ok, key=lambda r: r[0])[2]


def slow_here(kw: dict, flags: list[str]) -> bool:
    """A precision this CPU runs far slower than fp32: time it on a subset only."""
    from .quant import int8_pays
    if kw.get("precision") == "int8":
        return not int8_pays()
    if kw.get("precision") == "bf16":
        return not any(f in flags for f in ("avx512_bf16", "amx_bf16"))
    return False


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m decoder.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(DEFAULT_DATA, "model"))
    p.add_argument("--input", default=None, help="source lines (default: the Bible test split "
                   "next to the model, tests/fixtures/bible-tiny/test.en)")
    p.add_argument("--ref", default=None, help="reference lines for BLEU/chrF")
    p.add_argument("--lines", type=int, default=0, help="use the first N lines (0 = all)")
    p.add_argument("--repeat", type=int, default=1, help="synthetic larger input: the input K times")
    p.add_argument("--passes", type=int, default=1,
                   help="timed passes per configuration of ours; the fastest counts (noise on shared machines)")
    p.add_argument("--naive-lines", type=int, default=100,
                   help="the naive rows are slow: time them on the first N lines only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--ct2-isa", default=None, help="CT2_FORCE_CPU_ISA (default: best the CPU has)")
    p.add_argument("--skip", default="", help="comma list of: naive,hf,ct2,batch1")
    p.add_argument("--profile", action="store_true",
                   help="also profile the best configuration (top ops) into <name>-profile.txt")
    p.add_argument("--name", default=None, help="output name under docs/bench/")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "bench"))
    a = p.parse_args(argv)

    machine = cpu_info()
    isa = a.ct2_isa or ct2_isa(machine["flags"])
    os.environ["CT2_FORCE_CPU_ISA"] = isa  # before ctranslate2 is imported
    import torch
    torch.set_num_threads(a.threads)
    machine.update(torch=torch.__version__, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   threads=a.threads, ct2_isa=isa, python=platform.python_version(),
                   load_avg_at_start=os.getloadavg()[0], timing_passes=a.passes)
    try:
        import ctranslate2
        machine["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        ctranslate2 = None
    model_base = os.path.dirname(os.path.abspath(a.model))
    src_path = a.input or os.path.join(model_base, "test.en")
    ref_path = a.ref or (os.path.join(model_base, "test.es") if a.input is None else None)
    src = read(src_path)
    ref = read(ref_path) if ref_path and os.path.exists(ref_path) else None
    if a.lines:
        src, ref = src[:a.lines], ref[:a.lines] if ref else None
    lines, refs = src * a.repeat, (ref * a.repeat if ref else None)
    skip = set(filter(None, a.skip.split(",")))
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['flags'])}; "
          f"torch {machine['torch']} ({machine['torch_cpu_capability']}), {a.threads} threads, "
          f"CT2 ISA {isa}", file=sys.stderr)
    print(f"input: {src_path} ({len(src)} lines x {a.repeat})", file=sys.stderr)

    from .translator import Translator
    sp = Translator.__new__(Translator)  # only for token counting below
    _, sp.text = _text(a.model)
    n_src_words = lambda ls: sum(len(s.split()) for s in ls)  # noqa: E731
    n_tgt_tokens = lambda hs: sum(len(x) for x in sp.text.sp.encode(hs))  # noqa: E731

    rows = []

    def record(name, hyps, secs, sub):
        r = {"config": name, "lines": len(sub), "seconds": round(secs, 3),
             "src_words_per_s": round(n_src_words(sub) / secs, 1),
             "tgt_tokens_per_s": round(n_tgt_tokens(hyps) / secs, 1)}
        if refs:
            r["bleu"], r["chrf"] = scores(hyps, refs[:len(hyps)])
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)

    has_shortlist = sp.text.cfg.shortlist is not None  # rows with the switch only where there is a file
    cumulative, variants = ablation()
    full = []  # (words/s, BLEU, kw) of greedy rows timed on the whole input: candidates for "best"
    for name, kw in cumulative + variants:
        naive_row = not kw["cache"]
        if naive_row and "naive" in skip:
            continue
        sub = lines[:a.naive_lines] if (naive_row or slow_here(kw, machine["flags"])) and a.naive_lines else lines
        hyps, secs = run_ours(a.model, sub, a.threads, a.passes, max_tokens=a.max_tokens, **kw)
        record(name + (f" [first {len(sub)} lines]" if len(sub) < len(lines) else ""), hyps, secs, sub)
        if len(sub) == len(lines) and kw["beam"] == 1:
            full.append((rows[-1]["src_words_per_s"], rows[-1].get("bleu"), kw))
    best = pick_best(full)
    tag = describe(best)
    machine["best_config"] = {k: v for k, v in best.items()}
    if has_shortlist:
        hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens,
                              **{**best, "shortlist": True})
        record(f"best ({tag}) + lexical shortlist", hyps, secs, lines)
    hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens, **{**best, "beam": 4})
    record(f"best ({tag}), beam 4", hyps, secs, lines)
    hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens,
                          **{**best, "beam": 4, "fused_topk": True})
    record(f"best ({tag}), beam 4, + fused add+top-k (C++)", hyps, secs, lines)
    hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens,
                          **{**best, "beam": 4, "fused_topk": True, "fused_log_softmax": True})
    record(f"best ({tag}), beam 4, + fused log-softmax+top-k (C++)", hyps, secs, lines)
    if has_shortlist:
        hyps, secs = run_ours(a.model, lines, a.threads, a.passes, max_tokens=a.max_tokens,
                              **{**best, "beam": 4, "shortlist": True})
        record(f"best ({tag}), beam 4, + lexical shortlist", hyps, secs, lines)
    if "hf" not in skip:
        hyps, secs = run_hf(a.model, lines, a.threads)
        record("HF transformers M2M100, greedy, fp32", hyps, secs, lines)
    ct2_int8 = None
    if ctranslate2 is not None and "ct2" not in skip:
        from .convert import to_ctranslate2
        with tempfile.TemporaryDirectory() as tmp:
            ct2_dir = to_ctranslate2(a.model, os.path.join(tmp, "ct2"))
            for ct, beam in (("float32", 1), ("int8", 1), ("int8", 4)):
                hyps, secs = run_ct2(ct2_dir, a.model, lines, a.threads, ct, beam, a.max_tokens)
                record(f"CTranslate2 {ct}, {'greedy' if beam == 1 else f'beam {beam}'}", hyps, secs, lines)
                if ct == "int8" and beam == 1:
                    ct2_int8 = rows[-1]
            if "batch1" not in skip:
                sub = src[:min(len(src), 100)]
                hyps, secs = run_ours(a.model, sub, a.threads, a.passes,
                                      **{**best, "max_sentences": 1, "pipeline": False})
                record(f"latency: ours {tag} greedy, batch 1", hyps, secs, sub)
                hyps, secs = run_ct2(ct2_dir, a.model, sub, a.threads, "int8", 1, batch1=True)
                record("latency: CTranslate2 int8 greedy, batch 1", hyps, secs, sub)
    profile = None
    if a.profile:
        profile = profile_best(a.model, lines, a.threads, a.max_tokens, best)
    naive = rows[0] if rows and rows[0]["config"].startswith("naive") else None
    for r in rows:
        if naive:
            r["x_naive"] = round(r["src_words_per_s"] / naive["src_words_per_s"], 2)
        if ct2_int8:
            base = ct2_int8
            if r["config"].startswith("latency"):
                base = rows[-1] if rows[-1]["config"].startswith("latency: CT") else ct2_int8
            r["x_ct2_int8"] = round(r["src_words_per_s"] / base["src_words_per_s"], 2)
    machine["load_avg_at_end"] = os.getloadavg()[0]
    name = a.name or f"bench-{os.path.basename(os.path.abspath(a.model))}"
    os.makedirs(a.out_dir, exist_ok=True)
    md = to_markdown(rows, machine, src_path, len(src), a.repeat, a.model)
    with open(os.path.join(a.out_dir, name + ".md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(a.out_dir, name + ".json"), "w") as fh:
        json.dump({"machine": machine, "input": src_path, "lines": len(src), "repeat": a.repeat,
                   "model": os.path.abspath(a.model), "rows": rows}, fh, indent=2)
    if profile:
        with open(os.path.join(a.out_dir, name + "-profile.txt"), "w") as fh:
            fh.write(profile)
    print(md)


def profile_best(model_dir, lines, threads, max_tokens, best: dict) -> str:
    """Where the time of the best configuration goes: phases, then ops."""
    import torch
    from . import model as M
    from .translator import Translator
    tr = Translator(model_dir, threads=threads, **{**best, "max_tokens": max_tokens, "pipeline": False})
    tr.translate(lines[:8])
    phases = {"encode": 0.0, "decode steps": 0.0, "batch shrink": 0.0}

    def timed(f, key):
        def g(*args, **kw):
            t = time.perf_counter()
            r = f(*args, **kw)
            phases[key] += time.perf_counter() - t
            return r
        return g
    orig = (M.Model.encode, M.IncrementalState.step, M.IncrementalState.keep)
    M.Model.encode = timed(orig[0], "encode")
    M.IncrementalState.step = timed(orig[1], "decode steps")
    M.IncrementalState.keep = timed(orig[2], "batch shrink")
    try:
        t = time.perf_counter()
        tr.translate(lines)
        total = time.perf_counter() - t
    finally:
        M.Model.encode, M.IncrementalState.step, M.IncrementalState.keep = orig
    with torch.profiler.profile() as prof:
        tr.translate(lines)
    out = [f"best configuration ({best['precision']} greedy), {len(lines)} lines, {threads} threads: {total:.3f} s"]
    for k, v in phases.items():
        out.append(f"  {k:14s} {v:7.3f} s  {100 * v / total:5.1f}%")
    out.append(f"  {'rest':14s} {total - sum(phases.values()):7.3f} s  (search bookkeeping, text, batching)")
    out.append("")
    out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return "\n".join(out) + "\n"


def to_markdown(rows, machine, src_path, n, repeat, model) -> str:
    cols = [("config", "configuration"), ("src_words_per_s", "src words/s"), ("tgt_tokens_per_s", "tgt tokens/s"),
            ("bleu", "BLEU"), ("chrf", "chrF"), ("x_naive", "x naive"), ("x_ct2_int8", "x CT2 int8")]
    out = [f"Machine: {machine['cpu']}, {machine['cores']} cores, flags: {' '.join(machine['flags'])}; "
           f"torch {machine['torch']} ({machine['torch_cpu_capability']}), {machine['threads']} threads; "
           f"CTranslate2 {machine.get('ctranslate2', '-')} with CT2_FORCE_CPU_ISA={machine['ct2_isa']}; "
           f"load average {machine['load_avg_at_start']:.1f} at start, {machine['load_avg_at_end']:.1f} at end.",
           f"Model: `{model}`. Input: `{src_path}` ({n} lines x {repeat}).", "",
           "| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
