"""Build the submission image with the docker SDK (what `make image` runs).

    python -m submission.image [--model DIR] [--device cpu|gpu] [--tag TAG] [--base IMAGE] [--stage-only]

Builds the Dockerfile at the repository root (`docker build -t kit .` there
builds the same CPU image once --stage-only, `make image-context`, has staged
build/image/). Works from a checkout and from an installed package alike: an
installed kit has the Dockerfile and .dockerignore in submission/docker/, the
build context is sent as a tar of exactly the files .dockerignore admits, and
the staged inputs go to build/ of the checkout (installed: of the current
directory).

Two images: `cpu` (the CPU wheel of the host's torch) and `gpu`, for the WMT
GPU track: the CUDA build of the same torch and its nvidia-* libraries from
the package registry, and decoder/csrc's CUDA kernels compiled ahead of time
for sm_80 and sm_90 (plus PTX for later GPUs) with nvcc from the registry, by
tools/cuda_check.py in the venv `make cuda-check` uses. The GPU image's inputs
are staged in build/image-gpu/ and sent as the context's build/image/.

Steps, each cached: a base image (the public slim Python image when docker can
pull it, else `localbase:bookworm` made with debootstrap: this machine kind has
no Docker Hub), a wheelhouse of exactly the host's versions of the run-time
packages (the build stage installs offline from it), the model dir staged into
the build context, and the image itself, tagged with a key over all those
inputs so an unchanged tree skips the build entirely. The image carries OCI labels
(source, git revision, creation time, the model's hash); the build stage is kept
under one `wmt-kit-build:` tag as the cache of the next build, and an image a
rebuild takes the last tag from is removed: nothing is left dangling.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from datetime import datetime, timezone
from importlib import metadata
from typing import IO

from decoder.cliargs import checkout_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # a checkout, or site-packages
# Dockerfile and .dockerignore: at the top of a checkout; an installed kit has them in
# submission/docker/ (in a checkout, links to the top's: one file each)
DOCKER = ROOT if os.path.isfile(os.path.join(ROOT, "Dockerfile")) else os.path.join(ROOT, "submission", "docker")
# where runs/ and build/ are: the checkout, or (installed) the current directory
HOME = ROOT if os.path.isfile(os.path.join(ROOT, "pyproject.toml")) else os.getcwd()
CONTEXT_STAGE = "build/image"  # the Dockerfile COPYs the staged inputs from here, in the context
DEVICES = ("cpu", "gpu")
CUDA_ARCHS = "8.0;9.0+PTX"  # machine code for A100 and H100; PTX the driver compiles for later GPUs
CUDA_OPS = "/app/ops/decoder_ops_cuda.so"  # the GPU image's prebuilt CUDA kernels
PUBLIC_BASE, LOCAL_BASE = "python:3.11-slim-bookworm", "localbase:bookworm"
# What `import decoder` needs at run time, and nothing else: ctranslate2,
# transformers, matplotlib and sacrebleu stay out of the image.
RUNTIME = ["torch", "sentencepiece", "sacremoses", "safetensors", "numpy"]
IMAGE_PY = "3.11"  # both bases ship CPython 3.11
# wheels that run on the image's glibc (Debian bookworm: 2.36); the CUDA ones need 2.27
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(36, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
MODEL_FILES = ("config.json", "model.safetensors", "spm.model")


def log(msg: str) -> None:
    print(f"[image] {msg}", file=sys.stderr, flush=True)


def client():
    import docker
    try:
        c = docker.from_env(timeout=600)
        c.ping()
    except Exception as e:  # DockerException, connection errors: all mean "no daemon"
        raise SystemExit(f"error: no docker daemon ({str(e).splitlines()[0][:200]}); "
                         "start dockerd (see .ci/run)")
    return c


def has_image(c, name: str) -> bool:
    import docker
    try:
        c.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False


def apt_mirror() -> str:
    """The Debian URI apt already uses: the only mirror known to be reachable."""
    for f in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")) + ["/etc/apt/sources.list"]:
        if os.path.isfile(f):
            for line in open(f):
                parts = line.split()
                # the Debian archive itself: not -security, not a vendor repo (nodesource, ...)
                uri = parts[1] if parts[:1] in (["URIs:"], ["deb"]) and len(parts) > 1 else ""
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    return "http://deb.debian.org/debian"


def ensure_base(c, base: str | None) -> str:
    if base:
        if base == LOCAL_BASE and not has_image(c, base):
            debootstrap_base(c)
        return base
    if has_image(c, PUBLIC_BASE):
        return PUBLIC_BASE
    try:
        c.images.pull(PUBLIC_BASE)
        return PUBLIC_BASE
    except Exception as e:
        log(f"cannot pull {PUBLIC_BASE} ({str(e).splitlines()[0][:120]}); using {LOCAL_BASE}")
    if not has_image(c, LOCAL_BASE):
        debootstrap_base(c)
    return LOCAL_BASE


def debootstrap_base(c) -> None:
    """A minimal Debian bookworm with python3 + venv, imported as LOCAL_BASE (~45 s)."""
    if not shutil.which("debootstrap"):
        raise SystemExit("error: no public base image reachable and no debootstrap "
                         "(apt-get install debootstrap, or pass --base IMAGE)")
    log(f"building {LOCAL_BASE} with debootstrap from {apt_mirror()}")
    os.makedirs(os.path.join(HOME, "build"), exist_ok=True)
    rootfs = tempfile.mkdtemp(prefix="rootfs-", dir=os.path.join(HOME, "build"))
    try:
        subprocess.run(["debootstrap", "--variant=minbase",
                        "--include=python3,python3-venv,ca-certificates",
                        "bookworm", rootfs, apt_mirror()], check=True, stdout=subprocess.DEVNULL)
        clean_rootfs(rootfs)
        archive = rootfs + ".tar"
        with tarfile.open(archive, "w") as tar:  # devices, links and owners as they are
            tar.add(rootfs, arcname=".")
        repo, tag = LOCAL_BASE.split(":")
        c.api.import_image(src=archive, repository=repo, tag=tag)
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
        if os.path.exists(rootfs + ".tar"):
            os.remove(rootfs + ".tar")


def clean_rootfs(rootfs: str) -> None:
    """Empty apt's package cache and lists: dead weight in every layer above.

    No shell: a checkout path with a space once split `rm -rf {rootfs}/...` in two."""
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        top = os.path.join(rootfs, d)
        for name in os.listdir(top) if os.path.isdir(top) else []:
            path = os.path.join(top, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def stage_dir(device: str = "cpu") -> str:
    """Where an image's inputs are staged: the CPU image's where `docker build .` finds them."""
    return os.path.join(HOME, "build", "image" if device == "cpu" else f"image-{device}")


def repo(device: str = "cpu") -> str:
    """The image's repository: its key tags and build stage are kept apart from the other device's."""
    return "wmt-kit" if device == "cpu" else f"wmt-kit-{device}"


def pins(device: str = "cpu") -> list[str]:
    """The host's installed versions: the image runs what the tests ran. On the GPU
    the same torch version, in the build PyPI serves for Linux: the CUDA one."""
    out = [f"{p}=={metadata.version(p)}" for p in RUNTIME]
    return out if device == "cpu" else [re.sub(r"\+.*", "", p) for p in out]


def ensure_wheelhouse(device: str = "cpu") -> list[str]:
    wheels = os.path.join(stage_dir(device), "wheelhouse")
    want = "\n".join(pins(device)) + "\n"
    req = os.path.join(wheels, "requirements.txt")
    if os.path.isfile(req) and open(req).read() == want:
        return sorted(os.listdir(wheels))
    log(f"downloading wheels: {' '.join(pins(device))}" + (" (CUDA torch: about 2.6 GB)" if device == "gpu" else ""))
    shutil.rmtree(wheels, ignore_errors=True)
    os.makedirs(wheels)
    # For the image's Python and platform, not the host's: the host may differ.
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", wheels, "--only-binary=:all:",
           "--python-version", IMAGE_PY, *[a for p in PLATFORMS for a in ("--platform", p)]]
    if device == "gpu":
        from tools.cuda_check import registry_env  # a local wheel folder may offer only the +cpu build
        r = subprocess.run(cmd + pins(device), env=registry_env())
    else:
        # torch's CUDA wheels are several GB: on x86 Linux ask for the +cpu build first
        # (pip's find-links or PyTorch's CPU index); plain PyPI as the fallback.
        torch_pin = pins()[0]
        cpu = torch_pin if "+cpu" in torch_pin else torch_pin + "+cpu"
        rest = pins()[1:]
        r = subprocess.run(cmd + [cpu, *rest])
        if r.returncode:
            r = subprocess.run(cmd + ["--extra-index-url", "https://download.pytorch.org/whl/cpu", cpu, *rest])
    if r.returncode:
        raise SystemExit("error: pip download of the run-time wheels failed")
    open(req, "w").write(want)
    return sorted(os.listdir(wheels))


def stage_ops(device: str = "cpu") -> bool:
    """Build decoder/csrc on the host into the build context.

    The image has no compiler, and the JIT fallback would leave the container on
    the reference ops: slower, and not bit-identical to `python -m decoder` here.
    The host runs the image's torch (pins()) and Debian's glibc, so the library
    fits; its kernels choose their ISA at run time. Without a compiler the
    image still works, on the references, and says so once on stderr."""
    ops = os.path.join(stage_dir(device), "ops")
    shutil.rmtree(ops, ignore_errors=True)
    os.makedirs(ops)
    if device == "gpu":
        stage_cuda_ops(ops)
        return True
    # the library this checkout's decoder loads (make setup built it): a build of its own took
    # the image another 80 s on 2 cores for the same sources, torch and flags
    r = subprocess.run([sys.executable, "-c", "from decoder.ops import build_library; print(build_library())"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        log(f"fused ops not built ({(r.stderr.strip().splitlines() or ['?'])[-1][:200]}); "
            "the image will use the PyTorch references")
        return False
    shutil.copyfile(r.stdout.strip().splitlines()[-1], os.path.join(ops, "decoder_ops.so"))
    os.chmod(os.path.join(ops, "decoder_ops.so"), 0o644)
    return True


def stage_cuda_ops(ops: str) -> None:
    """The GPU image's ops: the CPU library and the CUDA kernels, compiled against
    the image's CUDA torch for CUDA_ARCHS by tools/cuda_check.py in its venv
    (`make cuda-check`'s, build/cuda-venv: torch from the GPU wheelhouse, nvcc
    from the registry). No GPU needed; a failed build fails the image, since a
    GPU image on the PyTorch references would be several times slower."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DECODER_OPS_LIBRARY", "DECODER_OPS_CUDA_LIBRARY", "DECODER_NO_CPP_OPS")}
    env["TORCH_CUDA_ARCH_LIST"] = CUDA_ARCHS  # the image's targets, whatever GPU this host has
    build = os.path.join(HOME, "build")
    r = subprocess.run([sys.executable, "-m", "tools.cuda_check", "--venv", os.path.join(build, "cuda-venv"),
                        "--find-links", os.path.join(stage_dir("gpu"), "wheelhouse"),
                        "--build-dir", os.path.join(build, "ops-build-cuda"), "--out", ops],
                       cwd=ROOT, env=env, stdout=sys.stderr)
    if r.returncode:
        raise SystemExit("error: the CUDA kernels did not build for the GPU image (python -m tools.cuda_check, above)")


def default_model() -> str:
    """The most recently exported student under runs/."""
    found = [os.path.dirname(p) for p in glob.glob(os.path.join(HOME, "runs", "**", "model.safetensors"),
                                                    recursive=True) if "student" in os.path.relpath(p, HOME)]
    if not found:
        from decoder.cliargs import refuse
        refuse("no exported student under runs/ (make distill), or pass MODEL=DIR")
    return max(found, key=lambda d: os.path.getmtime(os.path.join(d, "model.safetensors")))


def stage_model(model_dir: str, device: str = "cpu") -> None:
    from decoder.modeldir import ModelDirError, has_shortlist, load
    try:
        cfg = load(model_dir)[0]  # refuse to bake a broken model into an image
    except ModelDirError as e:
        raise SystemExit(f"error: {e}")
    model = os.path.join(stage_dir(device), "model")
    shutil.rmtree(model, ignore_errors=True)
    os.makedirs(model)
    # the shortlist too where the dir lists and has one: the container turns it on (serve.py)
    extra = (cfg.shortlist,) if has_shortlist(model_dir, cfg) else ()
    for f in MODEL_FILES + extra:
        shutil.copyfile(os.path.join(model_dir, f), os.path.join(model, f))
        os.chmod(os.path.join(model, f), 0o644)  # the image runs as a non-root user


def image_paths() -> list[str]:
    """The paths the image is built from: the `!` lines of .dockerignore, the one list."""
    with open(os.path.join(DOCKER, ".dockerignore")) as fh:
        return [ln.strip()[1:] for ln in fh if ln.strip().startswith("!")]


def stage(model_dir: str, device: str = "cpu") -> str:
    """Everything the Dockerfile needs beyond the sources, staged; no docker needed."""
    ensure_wheelhouse(device)
    stage_model(model_dir, device)
    stage_ops(device)
    return stage_dir(device)


def where(rel: str, device: str = "cpu") -> str:
    """The file here of the build-context path `rel` (the GPU image's stage is the context's build/image)."""
    if rel == "Dockerfile":
        return os.path.join(DOCKER, rel)
    if rel == CONTEXT_STAGE or rel.startswith(CONTEXT_STAGE + "/"):
        return stage_dir(device) + rel[len(CONTEXT_STAGE):]
    return os.path.join(ROOT, rel)


def sources(device: str = "cpu") -> list[str]:
    """Every build-context file the image depends on, as the context names it."""
    files = []
    for top in image_paths():
        path = where(top, device)
        if os.path.isfile(path):
            files.append(top)
        for d, dirs, names in os.walk(path):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            files += [os.path.join(top, os.path.relpath(os.path.join(d, n), path))
                      for n in sorted(names) if not n.endswith(".pyc")]
    return files


def context(device: str = "cpu") -> IO[bytes]:
    """The build context: a tar of sources(), which is all the Dockerfile may COPY,
    and the listed folders themselves (an empty ops/ is still there to COPY)."""
    fh = tempfile.TemporaryFile()
    with tarfile.open(fileobj=fh, mode="w") as tar:
        for f in [t for t in image_paths() if os.path.isdir(where(t, device))] + sources(device):
            tar.add(where(f, device), arcname=f, recursive=False)
    fh.seek(0)
    return fh


def input_key(base_id: str, device: str = "cpu") -> str:
    h = hashlib.sha256(f"{base_id}\0{device}".encode())
    for f in sources(device):
        h.update(f.encode() + b"\0")
        if f.startswith(CONTEXT_STAGE + "/wheelhouse/"):
            h.update(str(os.path.getsize(where(f, device))).encode())  # names carry versions
        else:
            with open(where(f, device), "rb") as fh:
                hashlib.file_digest(fh, lambda: h)  # streams the file into the running key
    return h.hexdigest()[:16]


def git_revision(root: str = ROOT) -> str:
    """The commit of the kit's own checkout at root, "unknown" outside one (an
    unpacked sdist, or the kit's files inside some other repository)."""
    commit = checkout_commit(root)
    return commit.removesuffix("+dirty") if commit else "unknown"


def source_url(root: str = ROOT) -> str:
    """The git remote, else pyproject's [project.urls] (Source, Repository, Homepage)."""
    r = subprocess.run(["git", "-C", root, "config", "--get", "remote.origin.url"], capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip()
    try:
        with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
            urls = tomllib.load(fh).get("project", {}).get("urls", {})
    except (OSError, tomllib.TOMLDecodeError):
        urls = {}
    return next((urls[k] for k in ("Source", "Repository", "Homepage") if k in urls), "unknown")


def model_hash(model_dir: str) -> str:
    """sha256 over the baked model files, name and bytes: what /model holds."""
    h = hashlib.sha256()
    for f in MODEL_FILES:
        h.update(f.encode() + b"\0")
        with open(os.path.join(model_dir, f), "rb") as fh:
            hashlib.file_digest(fh, lambda: h)
    return h.hexdigest()


def oci_labels(model_dir: str, root: str = ROOT, device: str = "cpu") -> dict:
    return {"org.opencontainers.image.title": "wmt-kit submission" + ("" if device == "cpu" else f" ({device})"),
            "org.opencontainers.image.source": source_url(root),
            "org.opencontainers.image.revision": git_revision(root),
            "org.opencontainers.image.created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "org.wmt-kit.model.sha256": model_hash(model_dir),
            "org.wmt-kit.device": device}


def _build(c, quiet: bool, device: str, **kw) -> None:
    with context(device) as ctx:
        _stream(c.api.build(fileobj=ctx, custom_context=True, dockerfile="Dockerfile", rm=True, forcerm=True,
                            decode=True, **kw), quiet)


def _stream(chunks, quiet: bool) -> None:
    for chunk in chunks:
        if "error" in chunk:
            raise SystemExit(f"error: docker build: {chunk['error'].strip()}")
        if not quiet and chunk.get("stream", "").strip():
            log(chunk["stream"].rstrip())


def stage_tag(base_id: str, device: str = "cpu") -> str:
    """The build stage's tag: keyed on what it is built from (base and wheelhouse)."""
    h = hashlib.sha256(base_id.encode())
    h.update(open(os.path.join(stage_dir(device), "wheelhouse", "requirements.txt"), "rb").read())
    h.update(open(os.path.join(DOCKER, "Dockerfile"), "rb").read())
    return f"{repo(device)}-build:{h.hexdigest()[:16]}"


def retag(c, image_id: str, tag: str) -> None:
    """Point tag at image_id; the image it leaves, if no tag remains on it, goes
    (else it would dangle: 1 GB of `<none>`)."""
    import docker
    repo, name = tag.rsplit(":", 1) if ":" in tag.split("/")[-1] else (tag, "latest")
    try:
        old = c.images.get(f"{repo}:{name}").id
    except docker.errors.ImageNotFound:
        old = None
    c.images.get(image_id).tag(repo, name)
    if old and old != image_id and not c.images.get(old).tags:
        try:
            c.images.remove(old)
        except docker.errors.APIError as e:  # a container still uses it: leave it
            log(f"kept the previous {tag} ({old[:19]}): {str(e)[:100]}")


def prune_old_keys(c, keep: str) -> None:
    """Drop earlier key tags: each is a ~1 GB image once its layers differ."""
    import docker
    repo = keep.split(":")[0]
    for im in c.images.list(name=repo):
        for t in im.tags:
            if t != keep and re.fullmatch(rf"{repo}:[0-9a-f]{{16}}", t):
                try:
                    c.images.remove(t)
                except docker.errors.APIError as e:  # in use by a container: keep it
                    log(f"kept {t}: {str(e)[:100]}")


def build(model_dir: str, tag: str | None = None, base: str | None = None, quiet: bool = False,
          device: str = "cpu") -> str:
    """Build (or find, by input key) the image; return its key tag `wmt-kit:KEY` (`wmt-kit-gpu:KEY`)."""
    c = client()
    base = ensure_base(c, base)
    stage(model_dir, device)
    base_id = c.images.get(base).id
    key_tag = f"{repo(device)}:{input_key(base_id, device)}"
    args = {"BASE_IMAGE": base}
    if has_image(c, key_tag):
        log(f"{key_tag} is up to date")
    else:
        log(f"building {key_tag} from {base}")
        # the build stage first, under a tag of its own: the legacy builder would leave
        # it untagged (a dangling 1.2 GB), and kept it is the next build's cache
        build_tag = stage_tag(base_id, device)
        _build(c, quiet, device, tag=build_tag, target="build", buildargs=args)
        cuda = {"CUDA_OPS_LIBRARY": CUDA_OPS} if device == "gpu" else {}  # the final stage's ARG only
        _build(c, quiet, device, tag=key_tag, buildargs={**args, **cuda}, labels=oci_labels(model_dir, device=device))
        prune_old_keys(c, key_tag)
        prune_old_keys(c, build_tag)
    if tag:
        retag(c, c.images.get(key_tag).id, tag)
    return key_tag


def main(argv=None) -> int:
    from decoder.cliargs import ArgumentParser, HelpFormatter, add_version, model_dir_error, refuse
    ap = ArgumentParser(prog="python -m submission.image", description=__doc__.splitlines()[0],
                        formatter_class=HelpFormatter)
    add_version(ap)
    ap.add_argument("--model", help="model dir to bake at /model (default: latest student under runs/)")
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="cpu: the CPU wheel of torch; gpu: the GPU track's image (CUDA torch, prebuilt CUDA kernels)")
    ap.add_argument("--tag", help="image tag to give the build (default: wmt-kit:latest, on gpu wmt-kit-gpu:latest)")
    ap.add_argument("--base", help=f"base image (default {PUBLIC_BASE}, else {LOCAL_BASE})")
    ap.add_argument("--stage-only", action="store_true",
                    help="stage build/image/ (wheels, model, ops) and stop: then `docker build -t kit .` at the root")
    a = ap.parse_args(argv)
    if a.stage_only and a.device != "cpu":
        ap.error("--stage-only stages the CPU image, which `docker build .` reads; "
                 "the GPU image is built by `make image DEVICE=gpu`")
    if a.model and (why := model_dir_error("--model", a.model)):
        refuse(why)  # before the docker daemon and minutes of wheels
    model = a.model or default_model()
    if a.stage_only:
        staged = os.path.relpath(stage(model), HOME)
        print(f"staged {staged}/ (model {model}); now, at the repository root: docker build -t kit .")
        return 0
    tag = a.tag or f"{repo(a.device)}:latest"
    key_tag = build(model, tag, a.base, device=a.device)
    size = client().images.get(key_tag).attrs["Size"]
    msize = sum(os.path.getsize(os.path.join(model, f)) for f in MODEL_FILES)
    print(f"image {tag} ({key_tag}): {size / 1e6:.0f} MB")
    print(f"model {model}: {msize / 1e6:.1f} MB on disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
