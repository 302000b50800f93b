# kvpool image: every role runs from it (see compose.yaml).
FROM python:3.11-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 numactl \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kvpool
COPY . .
ARG KVPOOL_ENGINE=cpu
RUN KVPOOL_ENGINE=${KVPOOL_ENGINE} KVPOOL_TEST_TOOLS=0 scripts/setup.sh
ENTRYPOINT [".venv/bin/kvpool"]
