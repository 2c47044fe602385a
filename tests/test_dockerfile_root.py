"""The Dockerfile at the repository root: `docker build -t kit .` there builds the
submission image (once `make image-context` has staged build/image/), and says
which command to run first when nothing is staged. `make image`
(submission/image.py) builds the same file: tests/test_container.py."""
import os
import re
import shutil
import subprocess

import pytest

from test_container import model_dir  # noqa: F401  (the fixture: the container tests' model and image key)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_image_builds_the_dockerfile_and_dockerignore_at_the_root():
    from submission import image
    assert image.DOCKER == ROOT
    assert image.where("Dockerfile") == os.path.join(ROOT, "Dockerfile")
    # the installed package's copies are the root's files, not second versions of them
    for f in ("Dockerfile", ".dockerignore"):
        assert os.path.samefile(os.path.join(ROOT, "submission", "docker", f), os.path.join(ROOT, f))


def test_the_gpu_stage_is_sent_as_the_contexts_build_image(tmp_path, monkeypatch):
    """One Dockerfile for both images: the GPU image's inputs (build/image-gpu/)
    go into the context under the names the Dockerfile COPYs."""
    from submission import image
    monkeypatch.setattr(image, "HOME", str(tmp_path))
    assert image.where("build/image/model/config.json") == str(tmp_path / "build/image/model/config.json")
    assert image.where("build/image/model/config.json", "gpu") == str(tmp_path / "build/image-gpu/model/config.json")
    assert image.where("decoder/ops.py", "gpu") == os.path.join(ROOT, "decoder", "ops.py")
    assert (image.repo("cpu"), image.repo("gpu")) == ("wmt-kit", "wmt-kit-gpu")  # key tags pruned apart
    cpu, gpu = image.pins("cpu"), image.pins("gpu")
    assert gpu[0] == re.sub(r"\+.*", "", cpu[0]) and "+" not in gpu[0] and gpu[1:] == cpu[1:]


def docker_cli_or_skip():
    import docker

    from test_container import docker_or_skip
    docker_or_skip()
    if not shutil.which("docker"):
        pytest.skip("no docker command line (the daemon answers the SDK only)")
    return docker.from_env(timeout=600)  # removing a 1 GB image on a busy daemon takes more than 30 s


def docker_build(context: str, tag: str, base: str) -> subprocess.CompletedProcess:
    # the legacy builder, as on machines without buildx; the Dockerfile needs nothing of BuildKit
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    # --force-rm: a failed step's container goes too (else it pins the layers below it)
    return subprocess.run(["docker", "build", "--force-rm", "-t", tag, "--build-arg", f"BASE_IMAGE={base}", "."],
                          cwd=context, env=env, capture_output=True, text=True, timeout=1800)


def remove_untagged_stage(c, log: str) -> None:
    """The legacy builder leaves a multi-stage build's first stage untagged (1.2 GB of
    `<none>`): the image printed just before the final stage's FROM, ours to remove."""
    import docker
    for stage in re.findall(r"---> ([0-9a-f]{12})\nStep \d+/\d+ : FROM", log):
        try:
            if not c.images.get(stage).tags:
                c.images.remove(stage)
        except docker.errors.APIError:  # gone already, or a container of another build uses it
            pass


@pytest.mark.slow
def test_docker_build_at_the_root_builds_an_image_that_translates(model_dir):
    from test_container import TEXT, chosen_precision, reference, run

    from submission.image import ensure_base, stage
    c = docker_cli_or_skip()
    base = ensure_base(c, None)
    stage(model_dir)  # what `make image-context` does
    tag = f"wmt-kit-root-test:{os.getpid()}"
    r = docker_build(ROOT, tag, base)
    try:
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        # a context of what .dockerignore admits: no .git, runs/, tests/ or tools/ went along
        listing = run(tag, ["sh", "-c", "ls /app; echo; ls /app/submission; echo; ls /app/ops; echo; ls /model"])
        # (__pycache__: the image compiles its bytecode at build time)
        assert [[n for n in d.split() if n != "__pycache__"] for d in listing.stdout.decode().split("\n\n")] == [
            ["decoder", "ops", "submission"], ["__init__.py", "container"], ["decoder_ops.so"],
            ["config.json", "model.safetensors", "spm.model"]], listing.stdout
        out = run(tag, ["/run.sh", "CPU-1", "throughput"], TEXT)
        assert out.exit_code == 0, out.stderr
        assert out.stdout == reference(model_dir, TEXT, ["--threads", "1"], chosen_precision(out.stderr))
    finally:
        if r.returncode == 0:
            c.images.remove(tag)
        remove_untagged_stage(c, r.stdout)


@pytest.mark.slow
def test_docker_build_without_a_staged_context_names_the_command_to_run(tmp_path):
    """A fresh clone has no build/image/: the build stops at its check, with one
    `error:` line that says what to run, not "file not found in build context"."""
    from submission.image import ensure_base
    c = docker_cli_or_skip()
    base = ensure_base(c, None)
    for f in ("Dockerfile", ".dockerignore"):
        shutil.copyfile(os.path.join(ROOT, f), tmp_path / f)
    r = docker_build(str(tmp_path), f"wmt-kit-root-test:unstaged-{os.getpid()}", base)
    try:
        assert r.returncode != 0
        errors = [ln for ln in (r.stdout + r.stderr).splitlines() if "error:" in ln and "make image-context" in ln]
        assert errors and "build/image/ is not staged" in errors[0], (r.stdout + r.stderr)[-3000:]
    finally:
        # the steps before the check leave their layers untagged: ours to remove
        for layer in re.findall(r"---> ([0-9a-f]{12})\n", r.stdout)[1:]:
            try:
                c.images.remove(layer)
            except Exception:  # a layer another build shares: not ours to remove
                pass
