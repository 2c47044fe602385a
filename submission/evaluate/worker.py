"""One local system in its own process, so its peak RSS is its own:

    python -m submission.evaluate.worker SPEC.json RESULT.json

SPEC: a System's config plus `lines` (the source file), `repeats`, `warmup_lines`,
`max_tokens`. The parent (local.py) sets OMP/MKL threads and CT2_FORCE_CPU_ISA in the
environment, since both must be fixed before torch or ctranslate2 is imported.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

from decoder.cliargs import GPU_MAX_TOKENS, MAX_TOKENS, version
from decoder.pipeline import normalise_processes
from decoder.textio import read_file


def peak_rss_mb(pids=()) -> float:
    """This process's peak RSS plus that of the live worker processes `pids` (their own
    peak, VmHWM: RUSAGE_CHILDREN counts only children already waited for)."""
    mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as fh:
                mb += next(int(ln.split()[1]) for ln in fh if ln.startswith("VmHWM:")) / 1024
        except (OSError, StopIteration, ValueError):
            pass
    return mb


def load(spec: dict, tmp: str):
    """-> (translate(lines) -> hyps, facts about the loaded system)."""
    engine, model = spec["engine"], spec["model_dir"]
    latency = spec["mode"] == "latency"
    if engine == "decoder":
        from decoder.translator import Translator
        extra = spec.get("extra", {})
        workers = extra.get("workers", 0)  # systems.decoder_layout: 1-thread worker processes
        tr = Translator(model, device=spec["device"], precision=spec["precision"],
                        threads=1 if workers else spec["threads"], workers=workers,
                        beam=spec["beam"], max_tokens=spec["max_tokens"], shortlist=extra.get("shortlist", False),
                        pipeline=not latency)  # one line at a time has nothing to overlap (serve.py)
        if tr.pool is not None:
            tr.pool.wait_started()  # their loading is load time, not the first timed pass
        return tr.translate, {"model_bytes": dir_bytes(model), "pids": tr.pool.pids() if tr.pool else []}
    if engine == "ct2":
        from tools.baselines import CT2Run, ct2_translator
        from tools.convert import to_ctranslate2
        from .systems import CT2_COMPUTE
        compute = CT2_COMPUTE[spec["precision"]]
        t = time.perf_counter()
        # quantised on disk as it runs, so the size on disk is the size of what runs
        ct2_dir = to_ctranslate2(model, os.path.join(tmp, "ct2"),
                                 quantization=None if compute == "float32" else compute)
        facts = {"convert_s": time.perf_counter() - t, "model_bytes": dir_bytes(ct2_dir)}
        cpu = not spec["device"].startswith("cuda")
        # the thread layout systems.ct2_layout chose (CT2's guide: parallel 1-thread workers for throughput)
        extra = spec.get("extra", {})
        inter, intra = extra.get("ct2_inter_threads", 1), extra.get("ct2_intra_threads", spec["threads"])
        # on a GPU as it is plainly used there: the whole input in one call, one cap, batches of our
        # decoder's GPU budget, and the text pipeline ours has (tools/bench_gpu.py: in one call per
        # length cap, its batches were a few dozen sentences whatever the size asked for)
        tokens = spec["max_tokens"] or (MAX_TOKENS if cpu else GPU_MAX_TOKENS // spec["beam"])
        run = CT2Run(compute, spec["beam"], inter_threads=inter, intra_threads=intra, max_batch_size=tokens,
                     use_vmap=extra.get("ct2_vmap", False), one_cap=not cpu)
        go = ct2_translator(ct2_dir, model, run, device="cpu" if cpu else "cuda",
                            text_processes=0 if cpu else normalise_processes())
        return go, facts
    if engine == "hf":
        from tools.baselines import hf_translator
        return hf_translator(model, spec["threads"], beam=spec["beam"]), {"model_bytes": dir_bytes(model)}
    raise ValueError(f"unknown engine {engine!r}")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if not f.startswith("."))


def measure(spec: dict) -> dict:
    lines = read_file(spec["lines"])
    latency = spec["mode"] == "latency"
    res = {"rss_start_mb": peak_rss_mb()}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        go, facts = load(spec, tmp)
        pids = facts.pop("pids", [])
        res.update(facts, load_s=time.perf_counter() - t - facts.get("convert_s", 0.0),
                   rss_after_load_mb=peak_rss_mb(pids))
        # warm-up: allocator, oneDNN primitive caches, CT2's first-call setup; timed apart
        warm = lines[:spec["warmup_lines"]]
        t = time.perf_counter()
        if latency:
            for x in warm:
                go([x])
        else:
            go(warm)
        res["warmup"] = {"seconds": time.perf_counter() - t, "lines": len(warm)}
        runs, outputs = [], []
        for _ in range(spec["repeats"]):
            if latency:
                hyps, lat = [], []
                for x in lines:
                    t = time.perf_counter()
                    hyps += go([x])
                    lat.append(time.perf_counter() - t)
                runs.append({"seconds": sum(lat), "latencies_s": lat})
            else:
                t = time.perf_counter()
                hyps = go(lines)
                runs.append({"seconds": time.perf_counter() - t})
            outputs.append(hyps)
        peak = peak_rss_mb(pids)
    res.update(runs=runs, hyps=outputs[-1], identical_repeats=all(o == outputs[0] for o in outputs),
               peak_rss_mb=peak)
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--version"]:  # every `python -m` command says it, this internal one too
        print(version())
        return 0
    if len(argv) != 2:
        print("usage: python -m submission.evaluate.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    try:
        res = measure(spec)
    except Exception as e:  # the parent reports it as this system's one error line
        res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    with open(argv[1], "w", encoding="utf-8") as fh:
        json.dump(res, fh)
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
