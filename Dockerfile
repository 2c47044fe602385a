# The WMT efficiency submission: `make image` prepares build/image/ (wheelhouse
# and model) and builds this; by hand: `docker build --build-arg
# BASE_IMAGE=localbase:bookworm .` after `make image` has staged build/image/.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# Build stage: the wheelhouse is needed only here, so its 200 MB never reach a
# layer of the final image. Installs are offline: the build has no registry.
FROM ${BASE_IMAGE} AS build
COPY build/image/wheelhouse /wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels -r /wheels/requirements.txt \
 && /opt/venv/bin/pip uninstall -q -y pip \
 # torch's test suite, C++ headers and cmake files serve extension builds only
 && cd /opt/venv/lib/python3*/site-packages/torch \
 && rm -rf test include share/cmake bin/protoc* \
 && find /opt/venv -name '*.a' -delete

FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --no-create-home --shell /usr/sbin/nologin wmt
# the runtime and the payload only: .dockerignore lists them (submission/image.py keys the image on it)
COPY decoder /app/decoder
COPY submission/__init__.py /app/submission/__init__.py
COPY submission/container /app/submission/container
COPY submission/container/run.sh /run.sh
# decoder/csrc compiled by `make image` on the host (no compiler in here); may be empty
COPY build/image/ops /app/ops
# bytecode now, since `wmt` cannot write it later; and a checkout under a
# strict umask must not leave the code unreadable to `wmt`
RUN python3 -m compileall -q /app && chmod -R a+rX /app && chmod a+rx /run.sh
COPY build/image/model /model
# /run.sh arguments pick threads and device.
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app PYTHONDONTWRITEBYTECODE=1 MODEL_DIR=/model \
    DECODER_OPS_LIBRARY=/app/ops/decoder_ops.so
USER wmt
WORKDIR /tmp
# `docker run -i IMAGE < in > out`: GPU if CUDA is visible, else CPU-ALL; throughput.
CMD ["/run.sh"]
