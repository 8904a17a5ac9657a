# syntax=docker/dockerfile:1
# densedev image: build the wheel (with the Cython extension) in a full toolchain stage, install it into a
# slim runtime.  Build from the repository root:  docker build -t densedev:0.1.0 .   (see deploy/README.md)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# A C compiler for the Cython extension; Cython itself comes from PyPI through the build requirements.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# One wheel for densedev (compiled here) plus wheels of every dependency, so the runtime stage installs
# offline and needs no compiler.
RUN pip wheel --no-cache-dir --wheel-dir /wheels . \
 && pip install --no-cache-dir --no-index --find-links /wheels densedev \
 && python -c "import densedev.accel as a; assert a.IMPLEMENTATION == 'cython', 'wheel lacks the extension'"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="densedev" \
      org.opencontainers.image.description="Kubernetes device plugin for SR-IOV VFs and RDMA devices" \
      org.opencontainers.image.licenses="Apache-2.0"
# The root filesystem is read-only in the DaemonSet: no .pyc writes at run time (pip compiled them).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# Installed from a bind mount of the build stage, so the wheels never become a layer of this image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels densedev \
 && python -c "import densedev.accel as a; assert a.IMPLEMENTATION == 'cython', a.IMPLEMENTATION"
# UID 0, but the DaemonSet drops every capability: the kubelet's device-plugin dir and kubelet.sock
# belong to root, so only root can create a socket there and connect (deploy/README.md explains).
USER 0:0
ENTRYPOINT ["densedev"]
CMD ["run", "--config", "/etc/densedev/config.json"]
