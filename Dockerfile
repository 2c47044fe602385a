# The WMT efficiency submission image.
#
#   make image [MODEL=DIR] [DEVICE=gpu]     stage build/image/ and build this (submission/image.py)
#   make image-context [MODEL=DIR]          stage build/image/ only; then, at the repository root:
#   docker build -t kit .                   (no Docker Hub: --build-arg BASE_IMAGE=localbase:bookworm)
#
# build/image/ holds what the sources do not: a wheelhouse of the host's exact
# run-time versions (the build installs offline: it needs no registry), the
# model dir and decoder/csrc compiled on the host (no compiler in the image).
# The build context is exactly what .dockerignore admits; submission/image.py
# sends those files and keys the image on them. The GPU image is this file on
# a GPU stage (CUDA torch, the CUDA kernels prebuilt for sm_80 and sm_90).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# Build stage: the wheelhouse is needed only here, so it never reaches a layer
# of the final image.
FROM ${BASE_IMAGE} AS build
# The wildcard lets a context without build/image reach the check below, which
# names the command to run, instead of a bare "file not found". (Dockerfile is
# there only because COPY needs one source that always exists.)
COPY Dockerfile build/image/wheelhous[e] /wheels/
RUN test -f /wheels/requirements.txt || { echo "error: build/image/ is not staged: run 'make image-context' (the model, wheels and ops), then docker build again" >&2; exit 1; }
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels -r /wheels/requirements.txt \
 # the CUDA torch's triton (600 MB) compiles for torch.compile only, which the decoder does not use
 && /opt/venv/bin/pip uninstall -q -y triton pip \
 # torch's test suite, C++ headers and cmake files serve extension builds only;
 # so do the CUDA wheels' headers (GPU stage)
 && cd /opt/venv/lib/python3*/site-packages \
 && rm -rf torch/test torch/include torch/share/cmake torch/bin/protoc* nvidia/*/include nvidia/*/*/include \
 && find /opt/venv -name '*.a' -delete

FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --no-create-home --shell /usr/sbin/nologin wmt
# the runtime and the payload only: .dockerignore lists them (submission/image.py keys the image on it)
COPY decoder /app/decoder
COPY submission/__init__.py /app/submission/__init__.py
COPY submission/container /app/submission/container
COPY submission/container/run.sh /run.sh
# decoder/csrc compiled by `make image` on the host (no compiler in here): decoder_ops.so,
# and in the GPU image decoder_ops_cuda.so; may be empty (the references run)
COPY build/image/ops /app/ops
# bytecode now, since `wmt` cannot write it later; and a checkout under a
# strict umask must not leave the code unreadable to `wmt`
RUN python3 -m compileall -q /app && chmod -R a+rX /app && chmod a+rx /run.sh
COPY build/image/model /model
# The GPU stage passes /app/ops/decoder_ops_cuda.so; empty: no prebuilt CUDA kernels.
ARG CUDA_OPS_LIBRARY=
# /run.sh arguments pick threads and device.
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app PYTHONDONTWRITEBYTECODE=1 MODEL_DIR=/model \
    DECODER_OPS_LIBRARY=/app/ops/decoder_ops.so DECODER_OPS_CUDA_LIBRARY=${CUDA_OPS_LIBRARY}
USER wmt
WORKDIR /tmp
# `docker run -i IMAGE < in > out`: GPU if CUDA is visible, else CPU-ALL; throughput.
CMD ["/run.sh"]
