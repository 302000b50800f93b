# kvpool image: every role runs from it (see compose.yaml). It holds the
# project's venv, /opt/kvpool/.venv, and nothing else beyond the base image.
#
#   docker build --network host -t kvpool .
#   docker build --network host --build-arg BASE_IMAGE=kvpool-base:bookworm -t kvpool .
#       (no registry: scripts/build-local-base.sh builds that base from Debian packages)
#
# deploy/build-extra/ (ignored by git) feeds pip in the build stage only:
#   wheels/*.whl           offered first, e.g. the CPU build of torch where the index has only CUDA builds
#   ca-certificates.crt    the CA bundle pip trusts, e.g. the host's where a proxy re-signs TLS
# Neither reaches the final image.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS runtime
# the transfer engine links libibverbs, librdmacm and libcurl even for TCP; stores bind their NUMA node with numactl;
# etcd-server: compose.standby.yaml's etcd runs from this image
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libcurl4 numactl \
    etcd-server \
 && rm -rf /var/lib/apt/lists/*

FROM runtime AS build
# the bind shim and the index's order (kvpool/native/*.c) are compiled here, not at run time; the order is an
# extension module, built against the interpreter's headers (Debian's Python, in a local base, keeps them apart)
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
 && { [ -f "$(python3.11 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] \
      || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3.11-dev; } \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kvpool
COPY deploy/build-extra/ /tmp/build-extra/
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/tmp/build-extra/wheels
# PyPI's torch for Linux is the CUDA build (GBs of libraries): --build-arg
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, or a CPU wheel in build-extra
ARG PIP_EXTRA_INDEX_URL
# torch first and pinned, in its own layer: the project's code changes far more often
RUN if [ -f /tmp/build-extra/ca-certificates.crt ]; then export PIP_CERT=/tmp/build-extra/ca-certificates.crt; fi \
 && python3.11 -m venv .venv \
 && .venv/bin/pip install --quiet torch==2.13.0
COPY pyproject.toml setup.py README.md ./
COPY kvpool kvpool
COPY services services
ARG KVPOOL_ENGINE=cpu
# then, away from the sources (cd /): build the shim and the order beside the installed package, check what the
# roles import
RUN if [ -f /tmp/build-extra/ca-certificates.crt ]; then export PIP_CERT=/tmp/build-extra/ca-certificates.crt; fi \
 && .venv/bin/pip install --quiet ".[${KVPOOL_ENGINE}]" \
 && cd / \
 && /opt/kvpool/.venv/bin/python -c "from kvpool import bind_shim; print(bind_shim.build())" \
 && /opt/kvpool/.venv/bin/python -c "from kvpool import native_build; print(native_build.build_index_order())" \
 && /opt/kvpool/.venv/bin/python -c "import kvpool.rpc.pool_pb2, mooncake.engine, torch"

FROM runtime
COPY --from=build /opt/kvpool/.venv /opt/kvpool/.venv
WORKDIR /opt/kvpool
ENTRYPOINT ["/opt/kvpool/.venv/bin/kvpool"]
