"""tools/gpu_session.sh without a GPU: it parses, refuses an unknown stage and a machine without
CUDA in one error line each, and the options it hands the kit's commands are ones they take."""
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "tools", "gpu_session.sh")


def sh(*args, **env):
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PY": sys.executable, **env})


def test_script_parses_and_refuses_an_unknown_stage(tmp_path):
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    r = sh("build", "trian", OUT=str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip() == \
        "error: unknown stage 'trian' (stages: build test kernels speed train bench distill)"
    assert not (tmp_path / "out").exists()  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_script_refuses_a_machine_without_cuda(tmp_path):
    r = sh(OUT=str(tmp_path / "out"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "CUDA" in lines[0]


def _command(stage: str, module: str) -> list[str]:
    """The options the script's `stage_<stage>` passes to `python -m <module>` (shell variables as
    placeholders; an option list empty by default, ${NAME:-} or "${name[@]}", left out)."""
    text = open(SCRIPT).read()
    body = re.search(rf"^stage_{stage}\(\) {{\n(.*?)^}}", text, re.S | re.M).group(1).replace("\\\n", " ")
    line = re.search(rf"\$PY -m {re.escape(module)} (.*?)(?:\|\||$)", body, re.M).group(1)
    return [re.sub(r"\$\{?\(?[^ ]*", "X", w) if "$" in w else w for w in shlex.split(line)
            if not re.fullmatch(r"\$\{\w+(:-|\[@\])\}", w)]


def test_train_stage_options_are_the_trainers():
    from student.train.__main__ import train_parser
    a = train_parser().parse_args([x if x != "X" else "2.5" for x in _command("train", "student.train")])
    assert a.preset == "student-6-1" and a.max_tokens is None  # the trainer sizes the batch for the GPU


def test_speed_and_bench_stage_options_are_the_tools():
    from student.train.speed import CONFIGS, batch_list
    opts = _command("speed", "student.train.speed")
    assert batch_list(opts[opts.index("--batches") + 1])[-1] is None and opts[opts.index("--device") + 1] == "cuda"
    assert opts[opts.index("--configs") + 1].split(",") == ["bf16", "bf16+no_cudnn"]  # both in CONFIGS:
    assert {"bf16", "bf16+no_cudnn"} <= set(CONFIGS)  # cuDNN's per-shape plans, side by side
    from tools.bench_gpu import parse_args
    opts = _command("bench", "tools.bench_gpu")
    ablate = re.search(r"^BENCH_ABLATE=\$\{BENCH_ABLATE-([\w,=+]*)\}", open(SCRIPT).read(), re.M).group(1)
    opts[opts.index("--ablate") + 1] = ablate  # the script's default list
    a = parse_args(opts)
    assert a.engines == ["ours", "ct2", "hf"] and a.passes == 2
    assert a.ablate == ["cuda_graphs", "graph_attention", "sync_every=4", "normalise_processes", "encode_ahead",
                       "short_gil_interval", "decode_ahead", "pipeline", "kv_row_table", "fused_log_softmax"]
    # every switch the registry says is not measured on a GPU is among them
    from decoder.optimisations import OPTIMISATIONS
    assert {o.name for o in OPTIMISATIONS if "GPU not measured" in o.worth} <= set(a.ablate)


def test_a_data_tarball_is_unpacked_where_data_is_absent(tmp_path):
    """A device call's carry is capped: data/ may come as build/carry/data.tar.xz (3 MB against 16)."""
    import tarfile
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "tools" / "gpu_session.sh").write_text(open(SCRIPT).read())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "marker.txt").write_text("corpus\n")
    (tree / "build" / "carry").mkdir(parents=True)
    with tarfile.open(tree / "build" / "carry" / "data.tar.xz", "w:xz") as t:
        t.add(tmp_path / "data", arcname="data")
    py = tmp_path / "py"  # a python that says yes to every check and does nothing
    py.write_text("#!/bin/sh\nexit 0\n")
    py.chmod(0o755)
    r = subprocess.run(["bash", str(tree / "tools" / "gpu_session.sh"), "build"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PY": str(py), "OUT": str(tmp_path / "out")})
    assert r.returncode == 0, r.stderr
    assert (tree / "data" / "marker.txt").read_text() == "corpus\n"


def test_a_stopped_distill_still_brings_back_each_finished_trainings_metrics(tmp_path):
    """A lent call may end before the report: the teacher's metrics (its test BLEU) come back anyway."""
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "tools" / "gpu_session.sh").write_text(open(SCRIPT).read())
    run = tree / "runs" / "gpu-default"
    (run / "teacher-1a2b" / "train").mkdir(parents=True)
    (run / "teacher-1a2b" / "train" / "metrics.json").write_text('{"test_bleu": 25.3}')
    (run / "student-3c4d" / "train").mkdir(parents=True)  # still training: no metrics yet
    (run / "manifest.json").write_text("{}")
    py, log = _fake_python(tmp_path)
    py.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$2" = student.distill ] && exit 124\nexit 0\n')
    r = subprocess.run(["bash", str(tree / "tools" / "gpu_session.sh"), "distill"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PY": str(py), "OUT": str(tmp_path / "out")})
    assert r.returncode == 1 and "-m student.distill --name gpu-default" in log.read_text()
    got = tmp_path / "out" / "distill"
    assert sorted(os.listdir(got)) == ["manifest.json", "teacher-1a2b.metrics.json"]
    assert (got / "teacher-1a2b.metrics.json").read_text() == '{"test_bleu": 25.3}'


def _fake_python(tmp_path):
    """A python that says yes to every check and logs its arguments, a line a call."""
    py, log = tmp_path / "py", tmp_path / "py.log"
    py.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 0\n')
    py.chmod(0o755)
    return py, log


def test_carried_fused_ops_are_taken_where_they_load_and_built_where_not(tmp_path):
    """build/carry/ops (make gpu-carry) saves the lent machine its compile where both libraries
    load into its torch; a probe that fails (another torch) leaves the kit to build its own."""
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "tools" / "gpu_session.sh").write_text(open(SCRIPT).read())

    def session(fails: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
        log = tmp_path / "py.log"
        log.unlink(missing_ok=True)
        py = tmp_path / "py"  # logs the libraries each call sees; the probe fails where asked
        py.write_text(f'#!/bin/sh\necho "${{DECODER_OPS_LIBRARY:-}}|${{DECODER_OPS_CUDA_LIBRARY:-}}" >> {log}\n'
                      + ('[ -n "$DECODER_OPS_LIBRARY" ] && echo "cpu no (load failed: undefined symbol)" && exit 1\n'
                         if fails else "") + "exit 0\n")
        py.chmod(0o755)
        r = subprocess.run(["bash", str(tree / "tools" / "gpu_session.sh"), "build"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PY": str(py), "OUT": str(tmp_path / "out")})
        return r, log.read_text().splitlines()

    r, calls = session(fails=False)  # nothing carried: no probe, the build stage compiles
    assert r.returncode == 0 and calls[-1] == "|" and "fused ops: the carried" not in r.stderr
    ops = tree / "build" / "carry" / "ops"
    ops.mkdir(parents=True)
    for name in ("decoder_ops.so", "decoder_ops_cuda.so", "sources.sha256"):
        (ops / name).write_bytes(b"\x7fELF")
    r, calls = session(fails=False)
    assert r.returncode == 0 and "carried build/carry/ops loaded" in r.stderr
    assert calls[-1] == f"{ops}/decoder_ops.so|{ops}/decoder_ops_cuda.so"  # the build stage's python
    r, calls = session(fails=True)
    assert r.returncode == 0 and "did not load (cpu no (load failed: undefined symbol)); building" in r.stderr
    assert calls[-2] == f"{ops}/decoder_ops.so|{ops}/decoder_ops_cuda.so" and calls[-1] == "|"


def test_carried_ops_are_refused_once_their_sources_changed(tmp_path):
    """The digest make gpu-carry writes beside the libraries: any byte, file or flag of the sources
    changed since, and the lent machine builds its own instead of measuring stale kernels; an edit
    to the rest of decoder/ops.py keeps the carried build (one cost a lease 83 s of compiling)."""
    import shutil
    from decoder import ops
    from tools.cuda_check import sources_digest
    csrc = tmp_path / "decoder" / "csrc"
    shutil.copytree(ops._HERE, csrc)
    shutil.copyfile(os.path.join(ROOT, "decoder", "ops.py"), tmp_path / "decoder" / "ops.py")
    digest = sources_digest(str(csrc))
    assert digest == sources_digest() and len(digest) == 64
    kernel = csrc / "fused_cuda.cu"
    kernel.write_text(kernel.read_text().replace("32", "16", 1))
    assert sources_digest(str(csrc)) != digest
    kernel.write_text(open(os.path.join(ops._HERE, "fused_cuda.cu")).read())
    (csrc / "new.h").write_text("")
    assert sources_digest(str(csrc)) != digest
    (csrc / "new.h").unlink()
    ops_py = tmp_path / "decoder" / "ops.py"
    shipped = ops_py.read_text()
    for flags in ("CFLAGS = ['-O2']", "CUDA_CFLAGS = ['-O2']", "SOURCES = ('fused_cpu.cpp',)"):
        ops_py.write_text(shipped + flags + "\n")
        assert sources_digest(str(csrc)) != digest, flags
    # how the ops load is not what they are built from: a carried build stays good across such edits
    ops_py.write_text(shipped.replace("def build_library(", "def build_library_(") + "_lock_name = 'x'\n")
    assert sources_digest(str(csrc)) == digest
    # the script's probe compares the carried digest with this checkout's, before loading anything
    probe = re.search(r'\$PY -c "\n(.*?)" "\$CARRIED/sources.sha256"', open(SCRIPT).read(), re.S).group(1)
    stale = tmp_path / "stale.sha256"
    stale.write_text(digest.replace(digest[0], "0" if digest[0] != "0" else "1") + "\n")
    r = subprocess.run([sys.executable, "-c", probe, str(stale)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("built from other sources")


def test_the_bench_gets_what_is_left_of_the_calls_seconds(tmp_path):
    """A lent machine's call has a hard limit (CALL_SECONDS): the bench's --time-limit is what is
    left of it less a margin, and a bench with under 30 s left does not start."""
    py, log = _fake_python(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    env = {"PY": str(py), "OUT": str(tmp_path / "out"), "BENCH_MODEL": str(model)}
    r = subprocess.run(["bash", SCRIPT, "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env, "CALL_SECONDS": "600"})
    assert r.returncode == 0, r.stderr
    bench = [x.split() for x in log.read_text().splitlines() if x.startswith("-m tools.bench_gpu")]
    assert len(bench) == 1
    limit = int(bench[0][bench[0].index("--time-limit") + 1])
    assert 600 - 30 - 10 <= limit <= 600 - 30
    log.unlink()
    r = subprocess.run(["bash", SCRIPT, "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env, "CALL_SECONDS": "45"})
    assert r.returncode == 1 and "not started" in r.stderr
    assert "tools.bench_gpu" not in log.read_text()
    r = subprocess.run(["bash", SCRIPT, "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})  # no CALL_SECONDS: no limit
    assert r.returncode == 0 and "--time-limit" not in log.read_text()


def test_a_hung_stage_is_stopped_at_its_cap_and_before_the_calls_end(tmp_path):
    """A hang in one stage (a test waiting forever) must not take the whole lent call: the test stage
    stops at TEST_SECONDS, any stage before CALL_SECONDS ends, and one with no time left never starts."""
    py, log = tmp_path / "py", tmp_path / "py.log"
    py.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$2" = pytest ] && sleep 60\nexit 0\n')
    py.chmod(0o755)

    def session(**env):
        out = tmp_path / f"out{len(env)}{env.get('CALL_SECONDS', '')}"
        r = subprocess.run(["bash", SCRIPT, "test"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PY": str(py), "OUT": str(out), **env})
        rows = [x.split("\t") for x in (out / "timings.tsv").read_text().splitlines()] \
            if (out / "timings.tsv").exists() else []
        return r, rows
    r, rows = session(TEST_SECONDS="2")
    assert r.returncode == 1 and rows[0][0] == "test" and rows[0][2] == "124" and int(rows[0][1]) < 10
    r, rows = session(CALL_SECONDS="19")  # 19 s less half the 30 s margin: stopped after about 4
    assert r.returncode == 1 and rows[0][2] == "124" and int(rows[0][1]) < 10
    r, rows = session(CALL_SECONDS="5")
    assert r.returncode == 1 and rows == [] and "not started" in r.stderr


def test_make_gpu_carry_packs_what_the_script_unpacks_and_pins_the_hosts_wheels():
    from importlib.metadata import PackageNotFoundError, version
    try:
        pins = [f"{p}=={version(p)}" for p in ("sacremoses", "ctranslate2")]
    except PackageNotFoundError:
        pytest.skip("the baselines are not installed here")
    r = subprocess.run(["make", "-s", "-n", "-o", "setup", "gpu-carry", f"VPY={sys.executable}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    recipe = " ".join(r.stdout.replace("\\\n", " ").split())
    script = open(SCRIPT).read()
    assert "tar cJf build/carry/data.tar.xz data" in recipe and '"$ROOT/build/carry/data.tar.xz"' in script
    check = recipe.split(" -m tools.cuda_check ", 1)[1].split(" pip download ")[0].split()
    assert check[check.index("--out") + 1] == "build/carry/ops" and "CARRIED=$ROOT/build/carry/ops" in script
    assert check[check.index("--torch") + 1] == "2.11.0"  # the lent machines' torch (GPU.md)
    assert "student.data prepare -q bible-en-es" in recipe  # the embedded corpus the distill stage reads
    download = recipe.split(" pip download ", 1)[1].split()
    assert download[-2:] == pins and "-d .whl" in " ".join(download)
    assert '"$ROOT"/.whl/*.whl' in script
