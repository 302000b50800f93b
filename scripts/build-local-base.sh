#!/usr/bin/env bash
# Build the Dockerfile's base image from Debian packages alone, for a host where
# no image registry answers: debootstrap a minimal bookworm, add python3.11 and
# venv, import it as a docker image. Prints how long it took and its size.
#
#   scripts/build-local-base.sh [IMAGE]        (default: kvpool-base:bookworm)
#   docker build --network host --build-arg BASE_IMAGE=kvpool-base:bookworm -t kvpool .
#
#   DEBIAN_MIRROR  where debootstrap and apt fetch from (default: deb.debian.org)
#   KVPOOL_BUILD_DIR  scratch space for the root file system (default: a mktemp dir; removed)
# Needs root, debootstrap and a running docker daemon.
set -euo pipefail

image="${1:-kvpool-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python3.11-venv brings ensurepip's wheels; ca-certificates lets Debian's pip
# (which trusts the system store) reach the index. The Dockerfile installs the
# rest, so the same Dockerfile works on python:3.11-slim-bookworm too. apt-get
# installs them after debootstrap: its --include fails to configure python3.11-venv.
packages=(python3.11 python3.11-venv ca-certificates)

for tool in debootstrap docker; do
  command -v "$tool" >/dev/null || { echo "build-local-base: $tool is not installed" >&2; exit 1; }
done
[ "$(id -u)" -eq 0 ] || { echo "build-local-base: debootstrap needs root" >&2; exit 1; }

scratch="${KVPOOL_BUILD_DIR:-$(mktemp -d /tmp/kvpool-base.XXXXXX)}"
rootfs="$scratch/rootfs"
trap 'rm -rf "$rootfs"; rm -f "$scratch/build.log"; rmdir "$scratch" 2>/dev/null || true' EXIT
start=$(date +%s)

log="$scratch/build.log"
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$log" 2>&1 \
  || { tail -20 "$rootfs/debootstrap/debootstrap.log" "$log" >&2 2>/dev/null; exit 1; }
chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${packages[@]}" >>"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
# what an image needs no copy of: package caches and lists, docs, man pages, locales
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
  "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old

tar -C "$rootfs" --numeric-owner -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase bookworm + ${packages[*]}" \
  - "$image" >/dev/null

seconds=$(( $(date +%s) - start ))
size=$(docker image inspect --format '{{.Size}}' "$image")
echo "build-local-base: $image built in ${seconds}s, $((size / 1000000)) MB"
