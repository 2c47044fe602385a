# One venv, everything installed by `make setup`; every other target depends on it.
SHELL := /bin/bash
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-stamp
APT_PKGS := sword-text-web sword-text-sparv apertium-eng-spa
TORCH_VERSION ?= 2.13.0

.PHONY: setup test distill bench clean help image image-context image-gpu-test gpu-carry evaluate cuda-check oldest-torch-check newest-torch-check

help:
	@echo "make distill   teacher -> distilled corpus -> student -> export -> report (embedded default)"
	@echo "make test      the test suite (what CI runs)"
	@echo "make evaluate  BLEU/chrF vs words/s for every system, Pareto chart (EVAL_ARGS=...)"
	@echo "make setup     create $(VENV) and install what the kit needs"
	@echo "make cuda-check  compile the CUDA kernels with nvcc (no GPU needed; fetches a CUDA torch)"
	@echo "make image     the submission image [MODEL=dir] [DEVICE=gpu]; make image-context, then docker build -t kit ."
	@echo "make gpu-carry  the corpus, wheels and prebuilt fused ops tools/gpu_session.sh needs on a GPU machine without network"
	@echo "make oldest-torch-check  the fused ops built and tested on the oldest torch the kit supports"
	@echo "make newest-torch-check  the same on the newest torch release ($(NEWEST_TORCH))"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "note: the embedded corpus and Apertium need Debian packages; run:"; \
	    echo "  sudo apt-get install -y --no-install-recommends$$missing"; \
	  fi; \
	fi
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve pulls the multi-GB CUDA build
	$(VPY) -m pip install -q "torch==$(TORCH_VERSION)" || $(VPY) -m pip install -q "torch>=2.4"
	$(VPY) -m pip install -q -e ".[test,baselines]"
	# a CUDA torch without a CUDA toolkit: nvcc from the registry, for the CUDA kernels
	$(VPY) -m tools.cuda_check --install-nvcc
	# the fused C++ ops now, not in the first decode (20-45 s); prints whether they (and the CUDA
	# kernels) loaded and if not why: then the PyTorch references run
	$(VPY) -c "from decoder import fused; print(fused.describe())"
	touch $@

# The submission image (the root Dockerfile); MODEL defaults to the latest exported
# student under runs/. DEVICE=gpu: the GPU track's image (CUDA torch, about 2.6 GB of
# wheels cached in build/image-gpu/, and nvcc from PyPI in $(CUDA_VENV)).
# Starts nothing: needs a running docker daemon (.ci/run shows how to start one).
# image-context stages build/image/ only (no docker): then `docker build -t kit .`.
MODEL ?=
DEVICE ?= cpu
IMAGE ?= $(if $(filter gpu,$(DEVICE)),wmt-kit-gpu:latest,wmt-kit:latest)
image: setup
	$(VPY) -c "import docker" 2>/dev/null || $(VPY) -m pip install -q -e ".[image]"
	$(VPY) -m submission.image $(if $(MODEL),--model $(call shq,$(MODEL))) --device $(call shq,$(DEVICE)) --tag $(call shq,$(IMAGE))
image-context: setup
	$(VPY) -m submission.image --stage-only $(if $(MODEL),--model $(call shq,$(MODEL)))

# Builds the GPU image and checks its contents and CPU fallback (tests/test_image_gpu.py):
# too slow and too big (about 9 GB of disk) for `make test`.
image-gpu-test: setup
	$(VPY) -c "import docker" 2>/dev/null || $(VPY) -m pip install -q -e ".[image]"
	KIT_TEST_GPU_IMAGE=1 $(VPY) -m pytest -q tests/test_image_gpu.py

# make distill [PRESET=default|wmt] [NAME=run] [NPROC=N] [TEACHER_CMD="apertium -u eng-spa" |
#   TEACHER_MODEL="dir [dir ...]" | TEACHER_HF=dir] [SRC=f.en TGT=f.es [SRC_LANG=.. TGT_LANG=..]]
#   [BASELINE=1] [MIX=1] [DISTILL_ARGS="--any --other option"]   (python -m student.distill --help)
PRESET ?= default
NPROC  ?= 1
DISTILL_LAUNCH = $(if $(filter-out 1,$(NPROC)),$(VPY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC),$(VPY))
shq = '$(subst ','\'',$(1))'
DISTILL_OPTS = --preset $(PRESET) $(if $(NAME),--name $(call shq,$(NAME))) \
  $(if $(TEACHER_CMD),--teacher-cmd $(call shq,$(TEACHER_CMD))) \
  $(foreach m,$(TEACHER_MODEL),--teacher-model $(call shq,$(m))) \
  $(if $(TEACHER_HF),--teacher-hf $(call shq,$(TEACHER_HF))) \
  $(if $(SRC),--src $(call shq,$(SRC))) $(if $(TGT),--tgt $(call shq,$(TGT))) \
  $(if $(SRC_LANG),--src-lang $(call shq,$(SRC_LANG))) $(if $(TGT_LANG),--tgt-lang $(call shq,$(TGT_LANG))) \
  $(if $(filter 1 yes true,$(BASELINE)),--baseline-student) $(if $(filter 0 no false,$(BASELINE)),--no-baseline-student) \
  $(if $(filter 1 yes true,$(MIX)),--mix-original)

distill: setup
	$(DISTILL_LAUNCH) -m student.distill $(DISTILL_OPTS) $(DISTILL_ARGS)

test: setup
	$(VPY) -m pytest -q --durations=30 tests; rc=$$?; if [ $$rc = 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# ablation table (docs/bench/); BENCH_ARGS e.g. --model DIR --threads 2
bench: setup
	$(VPY) -m tools.bench $(BENCH_ARGS)

# every system on one BLEU-vs-words/s chart (runs/evaluate/); EVAL_ARGS e.g.
#   --model student=DIR --teacher DIR --container wmt-kit:latest --mode both
evaluate: setup
	$(VPY) -m submission.evaluate $(EVAL_ARGS)

# What tools/gpu_session.sh needs on a lent GPU machine, which reaches no network: the embedded
# corpus extracted and prepared (build/carry/data.tar.xz, 3 MB; the script unpacks it) and the
# wheels the machine lacks in the host's versions, for its Python (.whl/), and the fused ops compiled
# against its torch for its GPUs (build/carry/ops: the script loads them where they load, and builds
# its own where not; the first time about 5 GB of CUDA torch and nvcc into build/). Carry build/carry
# and .whl with the call.
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= sacremoses ctranslate2
GPU_TORCH ?= 2.11.0
GPU_ARCH ?= 9.0
gpu-carry: setup
	KIT_DATA_DIR=$(CURDIR)/data $(VPY) -m student.data prepare -q bible-en-es >/dev/null
	mkdir -p build/carry && tar cJf build/carry/data.tar.xz data
	$(VPY) -m tools.cuda_check --venv build/cuda-venv-$(GPU_TORCH) --torch $(GPU_TORCH) --arch "$(GPU_ARCH)" \
	  --build-dir build/ops-build-carry --out build/carry/ops
	$(VPY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 -d .whl $(shell $(VPY) -c "import sys; from importlib.metadata import \
	  version as v; print(*(f'{p}=={v(p)}' for p in sys.argv[1:]))" $(GPU_WHEELS) 2>/dev/null)

# nvcc-compile decoder/csrc/fused_cuda.cu against the CUDA build of our torch and
# check every fused op has its CUDA kernel; no GPU needed. Without a CUDA torch it
# makes $(CUDA_VENV) with one and nvcc from PyPI (about 5 GB).
CUDA_VENV ?= build/cuda-venv
cuda-check: setup
	$(VPY) -m tools.cuda_check --venv $(CUDA_VENV)

# The oldest torch pyproject.toml accepts, in a venv of its own: decoder/csrc built against it
# (its extension flags are C++17) and the kernel tests run there. The registry's Linux wheel
# is the CUDA build, so this fetches about 5 GB (the CPU is all it uses); not part of `make test`.
OLDEST_TORCH ?= 2.4.0
OLDEST_VENV  ?= build/oldest-torch/venv
OLDEST_TESTS ?= tests/test_cpp17.py tests/test_fused_ops.py tests/test_shortlist.py tests/test_int8_gemm.py \
  tests/test_int8_gemv.py tests/test_ops_status.py tests/test_cross_attention.py tests/test_decoder_ops.py
oldest-torch-check:
	test -x $(OLDEST_VENV)/bin/python || $(PY) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q "torch==$(OLDEST_TORCH)" -e ".[test]"
	PYTHONPATH=$(CURDIR) $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OLDEST_TESTS)

# The same on the newest torch release, the one a plain `pip install` of the kit gets (its
# extension flags and headers are C++20, so the C++17 check skips there); about 5 GB too.
NEWEST_TORCH ?= 2.15.0
newest-torch-check:
	$(MAKE) oldest-torch-check OLDEST_TORCH=$(NEWEST_TORCH) OLDEST_VENV=build/newest-torch/venv

clean:
	rm -rf build .pytest_cache
