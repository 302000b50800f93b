#!/usr/bin/env bash
# Set up kvpool on a Debian host: system libraries, .venv/, the project.
# Safe to run again: every step checks what is already there.
#
#   KVPOOL_ENGINE=cpu   (default) transfer engine for CPU hosts, TCP
#   KVPOOL_ENGINE=cuda  the CUDA build of the transfer engine
#   KVPOOL_ENGINE=none  install no engine (bring your own, e.g. ROCm)
#   KVPOOL_TEST_TOOLS=0 skip docker-compose, iptables and iproute2 (only the tests use them)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
engine="${KVPOOL_ENGINE:-cpu}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# The transfer engine links against libibverbs, librdmacm and libcurl even for TCP;
# deploy/systemd's store unit binds its NUMA node with numactl. The tests check
# compose.yaml with docker-compose (tests/unit/test_deploy_tools.py) and build
# network namespaces with ip and iptables, which KVPOOL_TEST_TOOLS=0 leaves out. (The Dockerfile installs its own list.)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=() tools=()
# etcd-server: the master's standbys elect a leader through etcd (kvpool up --master-standbys; the tests start
# their own etcd on free ports and never the system's service, which setup leaves stopped)
for pkg in libibverbs1 librdmacm1 libcurl4 numactl etcd-server; do installed "$pkg" || missing+=("$pkg"); done
# the bind shim and the index's order (kvpool/native/*.c) are compiled here: a C compiler and libc headers
command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
# ... and the order, an extension module, against the interpreter's headers (Debian's Python keeps them apart)
[ -f "$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || missing+=(python3-dev)
if [ "${KVPOOL_TEST_TOOLS:-1}" != 0 ]; then
  installed docker-compose || tools+=(docker-compose)
  # the break-in tests firewall their network namespaces (tests/integration/test_attack_netns.py)
  command -v iptables >/dev/null 2>&1 || tools+=(iptables)
  command -v ip >/dev/null 2>&1 || tools+=(iproute2)
fi
if [ $((${#missing[@]} + ${#tools[@]})) -gt 0 ]; then
  echo "setup: installing ${missing[*]} ${tools[*]}" >&2
  as_root apt-get update -qq
  apt_install=(as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq)
  [ ${#missing[@]} -eq 0 ] || "${apt_install[@]}" "${missing[@]}" >/dev/null
  # without recommends: docker-compose would bring the docker daemon along
  [ ${#tools[@]} -eq 0 ] || "${apt_install[@]}" --no-install-recommends "${tools[@]}" >/dev/null
fi
# the package enables a system etcd; kvpool starts its own, so keep that one from holding ports and data
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ] \
    && systemctl is-enabled --quiet etcd 2>/dev/null; then
  as_root systemctl disable --now etcd >/dev/null 2>&1 || true
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($python --version)" >&2
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || "${pip[@]}" torch==2.13.0

case "$engine" in
  cpu|cuda) extras="$engine,dev" ;;
  none) extras="dev" ;;
  *) echo "setup: KVPOOL_ENGINE must be cpu, cuda or none, not '$engine'" >&2; exit 2 ;;
esac
"${pip[@]}" -e ".[$extras]"
.venv/bin/python -c "import kvpool.rpc.pool_pb2, mooncake.engine" 2>/dev/null \
  || { [ "$engine" = none ] || { echo "setup: the transfer engine does not import" >&2; exit 1; }; }
# every transfer-engine process preloads it, so the engine listens on its configured address only
.venv/bin/python -c "from kvpool import bind_shim; bind_shim.build()"
# the pool index's order of groups and its passes over groups in C (kvpool/native/lru.c; without it the index
# runs the same in Python)
.venv/bin/python -c "from kvpool import native_build; native_build.build_index_order()"
# bytecode for the project's own modules, made once: where PYTHONDONTWRITEBYTECODE is set (as on the development hosts),
# every service process would otherwise compile them again as it starts (about 0.3 s of CPU each)
.venv/bin/python -m compileall -q kvpool services >/dev/null
echo "setup: ready ($(.venv/bin/python --version), torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'), engine $engine)" >&2
