# syntax=docker/dockerfile:1
# densedev image: build the wheel (with the Cython extension) in a full toolchain stage, install it into a
# slim runtime.  Build from the repository root:  docker build -t densedev:0.1.0 .   (see deploy/README.md)
#
# Two base arguments: the build stage needs Python's headers (the official images carry them), the
# runtime stage only an interpreter and pip, so a runtime base without headers or compiler can be given
# (CI builds both from Debian packages: .ci/image.sh).  Either must have `python` and `pip` on PATH.
ARG BUILD_IMAGE=python:3.11-slim-bookworm
ARG RUNTIME_IMAGE=python:3.11-slim-bookworm

FROM ${BUILD_IMAGE} AS build
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

FROM ${RUNTIME_IMAGE}
# OCI annotations (image-spec annotations.md).  VERSION's default is pyproject.toml's (a test keeps them
# equal); REVISION and SOURCE are the commit and repository URL the builder passes in.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=
LABEL org.opencontainers.image.title="densedev" \
      org.opencontainers.image.description="Kubernetes device plugin for SR-IOV VFs and RDMA devices" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
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
# No arguments (the RDMA shared device plugin's DaemonSet passes none): run finds the config where the
# plugin it replaces keeps it, or at /etc/densedev/config.json (cli.DEFAULT_CONFIGS).
CMD ["run"]
