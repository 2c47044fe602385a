#!/bin/sh
# WMT efficiency task interface: /run.sh HARDWARE TASK < input > output
#   HARDWARE  GPU | CPU-1 | CPU-ALL   (none: GPU when CUDA is visible, else CPU-ALL)
#   TASK      latency | throughput    (none: throughput)
# All logic lives in submission/container/serve.py; this file only fixes the environment
# that must be set before Python starts.
set -eu
usage="usage: /run.sh [GPU|CPU-1|CPU-ALL] [latency|throughput] < input > output"
if [ $# -gt 2 ]; then
  # an ignored argument would run a mode the caller did not ask for
  echo "$usage (got $# arguments: $*)" >&2; exit 2
fi
hardware=${1:-auto}
task=${2:-throughput}
case "$hardware" in
  CPU-1)
    # one thread from the first instruction: OpenMP/MKL size their pools at load
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 ;;
  GPU|CPU-ALL|auto) ;;
  *) echo "$usage (got hardware '$hardware')" >&2; exit 2 ;;
esac
case "$task" in
  latency|throughput) ;;
  *) echo "$usage (got task '$task')" >&2; exit 2 ;;
esac
# numpy's OpenBLAS would start a thread per core in every process, unused by the
# decoder (torch has its own), each counted by a process limit (docker --pids-limit).
export OPENBLAS_NUM_THREADS=1
# exec: Python becomes the process `docker stop` signals (PID 1); serve.py handles SIGTERM
exec python3 -m submission.container.serve --hardware "$hardware" --task "$task" --model "${MODEL_DIR:-/model}"
