"""The GPU track's image (`make image DEVICE=gpu`): CUDA torch, the CUDA kernels
compiled ahead of time for sm_80 and sm_90, `/run.sh GPU` on the decoder's GPU
defaults, and CPU with one warning where no GPU is visible.

The first tests are cheap and always run. Building the image downloads about
2.6 GB of CUDA wheels and compiles the kernels with nvcc, too slow and too big
for `make test`: the image tests run with KIT_TEST_GPU_IMAGE=1
(`make image-gpu-test`), and docs/container.md records their last result."""
import glob
import json
import os
import shutil
import subprocess

import pytest

from test_container import TEXT, docker_or_skip, lines, model_dir, run  # noqa: F401  (model_dir: the fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_OPTIONS = {"max_tokens", "max_sentences", "batch_size"}


@pytest.mark.parametrize("task", ["throughput", "latency"])
def test_gpu_mode_is_cuda_fp16_on_the_decoders_gpu_batch_defaults(monkeypatch, model_dir, task):
    """No CPU-sized batch option reaches the Translator: on CUDA it sizes its
    batches for the GPU. Latency keeps its one sentence a batch."""
    import torch

    from submission.container.serve import settings
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    s = settings("GPU", model_dir, task)
    assert (s["device"], s["precision"]) == ("cuda", "fp16")
    assert BATCH_OPTIONS & set(s) == (set() if task == "throughput" else {"max_sentences"})
    if task == "latency":
        assert s["max_sentences"] == 1


def test_a_prebuilt_cuda_library_is_loaded_without_nvcc(monkeypatch, tmp_path, capsys):
    """The GPU image has no nvcc: DECODER_OPS_CUDA_LIBRARY names its kernels, and
    a library that does not load costs the kernels only, with one warning."""
    import torch
    import torch.utils.cpp_extension as ext

    from decoder import ops
    saved = dict(ops._state)  # _build_cuda records why the kernels are out: the process's status
    try:
        monkeypatch.setattr(ext, "CUDA_HOME", None)
        loaded = []
        monkeypatch.setattr(torch.ops, "load_library", loaded.append)
        monkeypatch.setenv("DECODER_OPS_CUDA_LIBRARY", "/app/ops/decoder_ops_cuda.so")
        assert ops._build_cuda() is True and loaded == ["/app/ops/decoder_ops_cuda.so"]
        monkeypatch.undo()
        monkeypatch.setenv("DECODER_OPS_CUDA_LIBRARY", str(tmp_path / "missing.so"))
        assert ops._build_cuda() is False
        err = capsys.readouterr().err.splitlines()
    finally:
        ops._state.clear()
        ops._state.update(saved)
    assert len(err) == 1 and err[0].startswith("warning: fused CUDA kernels unavailable"), err


def test_the_gpu_stage_compiles_the_kernels_for_sm80_and_sm90_with_cuda_check(monkeypatch, tmp_path):
    from submission import image
    monkeypatch.setattr(image, "HOME", str(tmp_path))
    monkeypatch.setenv("DECODER_OPS_LIBRARY", "/somewhere/else.so")  # must not make it load another library
    calls = []

    def fake_run(argv, **kw):
        calls.append((argv, kw["env"]))
        return subprocess.CompletedProcess(argv, 1)
    monkeypatch.setattr(image.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="^error: the CUDA kernels did not build"):
        image.stage_cuda_ops(str(tmp_path / "ops"))
    (argv, env), = calls
    assert argv[1:3] == ["-m", "tools.cuda_check"]
    assert argv[argv.index("--out") + 1] == str(tmp_path / "ops")
    assert argv[argv.index("--venv") + 1] == str(tmp_path / "build" / "cuda-venv")  # `make cuda-check`'s
    assert argv[argv.index("--find-links") + 1] == str(tmp_path / "build" / "image-gpu" / "wheelhouse")
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX" and "DECODER_OPS_LIBRARY" not in env


@pytest.fixture(scope="module")
def gpu_image(model_dir):
    if os.environ.get("KIT_TEST_GPU_IMAGE") != "1":
        pytest.skip("builds the GPU image (2.6 GB of CUDA wheels, nvcc): KIT_TEST_GPU_IMAGE=1, "
                    "or make image-gpu-test")
    docker_or_skip()
    from submission.image import build
    return build(model_dir, quiet=True, device="gpu")


def in_image(image, code: str) -> str:
    r = run(image, ["python3", "-c", code])
    assert r.exit_code == 0, r.stderr.decode()[-2000:]
    return r.stdout.decode()


def cuobjdump() -> str:
    """The toolkit's reader of fatbinaries: the kernels' build venv has it (in torch's
    triton dependency, which the image leaves out), an installed toolkit too."""
    found = sorted(glob.glob(os.path.join(ROOT, "build", "cuda-venv", "lib", "python3*", "site-packages",
                                          "triton", "backends", "nvidia", "bin", "cuobjdump")))
    found += [p for p in ("/usr/local/cuda/bin/cuobjdump", shutil.which("cuobjdump")) if p and os.path.isfile(p)]
    assert found, "no cuobjdump: build/cuda-venv (made by the GPU image's build) should have one"
    return found[0]


@pytest.mark.slow
def test_gpu_image_has_cuda_torch_and_kernels_for_sm80_and_sm90(gpu_image, tmp_path):
    import docker
    assert in_image(gpu_image, "import torch; print(torch.version.cuda)").strip() not in ("", "None")
    env = dict(e.split("=", 1) for e in docker.from_env().images.get(gpu_image).attrs["Config"]["Env"])
    lib = env["DECODER_OPS_CUDA_LIBRARY"]
    assert lib == "/app/ops/decoder_ops_cuda.so"
    so = tmp_path / "decoder_ops_cuda.so"
    so.write_bytes(run(gpu_image, ["cat", lib]).stdout)
    out = subprocess.run([cuobjdump(), "--list-elf", "--list-ptx", str(so)], capture_output=True, text=True,
                         check=True).stdout
    assert ".sm_80.cubin" in out and ".sm_90.cubin" in out and ".sm_90.ptx" in out, out


@pytest.mark.slow
def test_gpu_image_run_sh_gpu_runs_the_gpu_defaults(gpu_image):
    code = ("import json, torch; torch.cuda.is_available = lambda: True; "
            "from submission.container.serve import settings; print(json.dumps(settings('GPU', '/model')))")
    s = json.loads(in_image(gpu_image, code))
    assert (s["device"], s["precision"]) == ("cuda", "fp16") and not BATCH_OPTIONS & set(s), s


@pytest.mark.slow
@pytest.mark.parametrize("task", ["throughput", "latency"])
def test_gpu_image_without_a_gpu_warns_once_and_translates_on_cpu(gpu_image, task):
    r = run(gpu_image, ["/run.sh", "GPU", task], TEXT)
    assert r.exit_code == 0, r.stderr.decode()[-2000:]
    assert len(lines(r.stdout)) == len(lines(TEXT))
    err = [x for x in r.stderr.decode().splitlines() if not x.startswith("decoder: precision ")]
    assert len(err) == 1 and err[0].startswith("warning: GPU requested but CUDA is not visible"), err
    assert "unavailable" not in r.stderr.decode()  # the prebuilt CPU ops loaded under the CUDA torch
