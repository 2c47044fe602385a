#!/usr/bin/env bash
# tools/gpu_session.sh [STAGE ...]: the kit's GPU checks and measurements on a fresh CUDA machine,
# one command. Stages, in this order (default: all of them):
#   build    compile the fused CPU ops and the CUDA kernels (or load build/carry/ops); say which loaded (~1 min)
#   test     pytest tests/test_decoder_gpu.py tests/test_fused_ops.py tests/test_shortlist.py
#   kernels  python -m tools.bench_kernels: the 16-byte-load kernels against the older ones (~10 s)
#   speed    trainer tokens/s of student-6-1 at several batch sizes and `auto`, SDPA with and without cuDNN (~2 min)
#   train    a student-6-1 with the GPU-sized trainer, TRAIN_MINUTES, exported       (~4 min)
#   bench    python -m tools.bench_gpu on BENCH_LINES lines of the training source    (~8 min)
#   distill  the default `make distill` path (python -m student.distill), timed      (~12 min; target 20)
# Everything it writes goes under $OUT (default runs/gpu-session): one log per stage, timings.tsv
# (stage, seconds, exit status), the bench's tables and summary, the trainer's and the distillation's
# reports (and each of the distillation's finished trainings' metrics, the report or not). Stages are
# independent where they can be: bench uses BENCH_MODEL, else the train stage's model; a rerun of distill
# resumes its run (runs/gpu-default), so a time limit per call costs nothing.
# Environment: OUT, PY (python3), KIT_DATA_DIR (default data/ here when present, unpacked from build/carry/data.tar.xz if only that is), TRAIN_MINUTES (2.5),
# BENCH_LINES (10000), BENCH_MODEL, BENCH_ARGS (extra options to tools.bench_gpu, as --engines ours,ct2),
# BENCH_ABLATE (the switches also measured flipped and settings changed, --ablate: cuda_graphs,graph_attention,
#   sync_every=4, and every switch whose GPU worth is not measured yet: normalise_processes,encode_ahead,
#   short_gil_interval,decode_ahead,pipeline, and the beam switches kv_row_table,fused_log_softmax, measured in the
#   beam 4 group),
# DISTILL_NAME (gpu-default), DISTILL_ARGS (extra options), CALL_SECONDS (the seconds this call may run, where a lent
#   machine's call has a hard limit: the bench then gets what is left, less a margin, as --time-limit and ends with
#   its files written, and no stage runs past it; unset: no limit), TEST_SECONDS (300: the test stage's cap).
# Packages the machine lacks (ctranslate2, sacremoses) may come as wheels in .whl/: installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
OUT=${OUT:-$ROOT/runs/gpu-session}
TRAIN_MINUTES=${TRAIN_MINUTES:-2.5}
BENCH_LINES=${BENCH_LINES:-10000}
BENCH_ABLATE=${BENCH_ABLATE-cuda_graphs,graph_attention,sync_every=4,normalise_processes,encode_ahead,short_gil_interval,decode_ahead,pipeline,kv_row_table,fused_log_softmax}  # switches flipped, settings changed ("": none)
DISTILL_NAME=${DISTILL_NAME:-gpu-default}
CALL_SECONDS=${CALL_SECONDS:-}
CALL_MARGIN=30  # the bench's start-up before its clock, its last row's overrun and writes, the caller's packing
TEST_SECONDS=${TEST_SECONDS:-300}  # the test stage's cap (on the H200: 40 s, then 127 s for 386 tests): a hang costs no more
STUDENT=$ROOT/runs/gpu-student
ALL=(build test kernels speed train bench distill)
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=("${ALL[@]}")
for s in "${STAGES[@]}"; do
  case " ${ALL[*]} " in *" $s "*) ;; *) echo "error: unknown stage '$s' (stages: ${ALL[*]})" >&2; exit 2;; esac
done
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
  echo "error: torch sees no CUDA GPU here; tools/gpu_session.sh is for a GPU machine" >&2; exit 2; }
mkdir -p "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# data/ may come as build/carry/data.tar.xz (3 MB against 16: what a call carries may be capped)
if [ ! -d "$ROOT/data" ] && [ -f "$ROOT/build/carry/data.tar.xz" ]; then tar -xJf "$ROOT/build/carry/data.tar.xz" -C "$ROOT"; fi
if [ -z "${KIT_DATA_DIR:-}" ] && [ -d "$ROOT/data" ]; then export KIT_DATA_DIR=$ROOT/data; fi

say() { echo "[gpu_session $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/session.log" >&2; }

# Wheels carried in .whl/ (no network on a lent machine), into a private site dir.
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  SITE=${TMPDIR:-/tmp}/kit-site
  $PY -m pip install -q --no-index --no-deps --target "$SITE" "$ROOT"/.whl/*.whl && export PYTHONPATH=$PYTHONPATH:$SITE
fi
# CTranslate2's PyPI wheel wants libcublas.so.12; a CUDA 13 torch ships libcublas.so.13. Same API for
# what CTranslate2 calls: offer the 13 under the 12 name, only where no 12 is found.
if ! $PY -c "import ctypes; ctypes.CDLL('libcublas.so.12')" 2>/dev/null; then
  LIB=$($PY -c "import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); \
print(next(iter(sorted(glob.glob(d + '/nvidia/*/lib/libcublas.so.1[3-9]*'))), ''))" 2>/dev/null)
  if [ -n "$LIB" ]; then
    LINKS=${TMPDIR:-/tmp}/kit-cublas12; mkdir -p "$LINKS"
    for f in libcublas libcublasLt; do
      ln -sf "$(ls "$(dirname "$LIB")"/$f.so.1[3-9]* | head -1)" "$LINKS/$f.so.12"
    done
    export LD_LIBRARY_PATH=$LINKS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
fi

# The fused ops built ahead where there is network (make gpu-carry: build/carry/ops, against the lent machine's
# torch, with the digest of their sources): where both load here and the sources are this checkout's, every
# stage takes them as they are and nothing compiles (the build stage took 58 s of a 15-minute lease); where
# not (another torch, changed sources), the kit builds its own, as without them.
CARRIED=$ROOT/build/carry/ops
if [ -z "${DECODER_OPS_LIBRARY:-}" ] && [ -f "$CARRIED/sources.sha256" ]; then
  if DECODER_OPS_LIBRARY=$CARRIED/decoder_ops.so DECODER_OPS_CUDA_LIBRARY=$CARRIED/decoder_ops_cuda.so $PY -c "
import sys
from decoder import fused, ops
from tools.cuda_check import sources_digest
if open(sys.argv[1]).read().strip() != sources_digest():
    sys.exit('built from other sources than decoder/csrc here: make gpu-carry again')
print(fused.describe())
sys.exit(0 if ops.available() and ops.cuda_available() else 1)" "$CARRIED/sources.sha256" >"$OUT/carried-ops.log" 2>&1; then
    export DECODER_OPS_LIBRARY=$CARRIED/decoder_ops.so DECODER_OPS_CUDA_LIBRARY=$CARRIED/decoder_ops_cuda.so
    say "fused ops: the carried build/carry/ops loaded; nothing to compile"
  else
    say "fused ops: the carried build/carry/ops did not load ($(tail -n 1 "$OUT/carried-ops.log")); building them here"
  fi
fi

# run NAME CMD...: CMD's output in $OUT/NAME.log, its seconds and exit status in timings.tsv. CMD is stopped
# (status 124) after LIMIT seconds, a stage's own cap where one is set, and before the call's CALL_SECONDS end
# (half the margin before it), so that a hung stage leaves the later ones, and the caller, their time.
run() {
  local name=$1; shift
  local cap=${LIMIT:-}
  if [ -n "$CALL_SECONDS" ]; then
    local left=$((CALL_SECONDS - SECONDS - CALL_MARGIN / 2))
    if [ -z "$cap" ] || [ "$left" -lt "$cap" ]; then cap=$left; fi
    [ "$cap" -gt 0 ] || { say "$name: no time left of the call's $CALL_SECONDS s; not started"; return 2; }
  fi
  say "$name: $*"
  local t0=$SECONDS
  if [ -n "$cap" ]; then
    timeout -k 5 "$cap" "$@" >"$OUT/$name.log" 2>&1
  else
    "$@" >"$OUT/$name.log" 2>&1
  fi
  local rc=$?
  [ $rc -eq 124 ] && echo "stopped after its limit of $cap s" >>"$OUT/$name.log"
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$rc" >>"$OUT/timings.tsv"
  tail -n 5 "$OUT/$name.log" >&2
  say "$name: exit $rc after $((SECONDS - t0)) s"
  return $rc
}

stage_build() {
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  run build $PY -c "
import os, torch
from decoder import ops
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.get_device_name(0))
print('fused CPU ops loaded:', ops.available())
print('CUDA kernels loaded:', ops.cuda_available())
print('from:', os.environ.get('DECODER_OPS_CUDA_LIBRARY') or 'built here')
"
}

stage_test() {
  LIMIT=$TEST_SECONDS run test $PY -m pytest -q -p no:cacheprovider tests/test_decoder_gpu.py tests/test_fused_ops.py \
    tests/test_shortlist.py --junitxml="$OUT/test.xml"
}

stage_kernels() {
  run kernels $PY -m tools.bench_kernels --out "$OUT/kernels.json"
}

stage_speed() {
  run speed $PY -m student.train.speed --device cuda --preset student-6-1 --configs bf16,bf16+no_cudnn \
    --batches 3072,12288,24576,49152,auto --steps 40 --warm 8 --passes 1 --out "$OUT/training-speed.json"
}

stage_train() {
  run train $PY -m student.train --preset student-6-1 --out "$STUDENT" --max-minutes "$TRAIN_MINUTES" \
    --eval-every 200 --dev-max 300 || return
  run export $PY -m student.export "$STUDENT/best.pt" "$STUDENT/model" || return
  mkdir -p "$OUT/train" && cp "$STUDENT/metrics.json" "$STUDENT/sizes.json" "$OUT/train/"
}

stage_bench() {
  local model=${BENCH_MODEL:-$STUDENT/model}
  [ -d "$model" ] || { say "bench: no model dir $model (run the train stage or set BENCH_MODEL)"; return 2; }
  run bench-data $PY -c "
import sys
from decoder import durable
from student.data import prepare
src, tgt = prepare('bible-en-es', verbose=False).read('train')
n = int(sys.argv[1])
durable.write_lines('$ROOT/runs/gpu-bench.en', src[:n])
durable.write_lines('$ROOT/runs/gpu-bench.es', tgt[:n])
" "$BENCH_LINES" || return
  mkdir -p "$OUT/bench"
  local limit=()
  if [ -n "$CALL_SECONDS" ]; then
    local left=$((CALL_SECONDS - SECONDS - CALL_MARGIN))
    [ "$left" -ge 30 ] || { say "bench: only $left s of the call's $CALL_SECONDS left; not started"; return 2; }
    limit=(--time-limit "$left")
  fi
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  run bench $PY -m tools.bench_gpu --model "$model" --src "$ROOT/runs/gpu-bench.en" --ref "$ROOT/runs/gpu-bench.es" \
    --passes 2 --ablate "$BENCH_ABLATE" --out "$OUT/bench/gpu-$(date -u +%Y-%m-%d)" \
    --summary "$OUT/bench/summary-gpu.json" "${limit[@]}" ${BENCH_ARGS:-}
}

stage_distill() {
  # shellcheck disable=SC2086  # DISTILL_ARGS is a list of options
  run distill $PY -m student.distill --name "$DISTILL_NAME" ${DISTILL_ARGS:-}
  local rc=$? d=$ROOT/runs/$DISTILL_NAME
  mkdir -p "$OUT/distill"
  for f in report.md report.json manifest.json; do [ -f "$d/$f" ] && cp "$d/$f" "$OUT/distill/"; done
  # each finished training's metrics (the teacher's test BLEU), also from a call stopped before the report
  local m
  for m in "$d"/*/train/metrics.json; do
    [ -f "$m" ] && cp "$m" "$OUT/distill/$(basename "$(dirname "$(dirname "$m")")").metrics.json"
  done
  return $rc
}

status=0
for s in "${STAGES[@]}"; do
  "stage_$s" || status=1
done
say "done (timings: $OUT/timings.tsv)"
exit $status
