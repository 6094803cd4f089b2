#!/usr/bin/env bash
# Make the images' base from Debian packages alone, for hosts that reach Debian's mirror but no
# image registry (Docker Hub): Debian bookworm with python3, pip, venv and ca-certificates,
# imported into the local engine as $TAG. Elsewhere a registry image does the same job: build
# with --build-arg BASE_IMAGE=python:3.11-slim (or any Debian/Ubuntu image with python3-venv).
#
#   deploy/make-base-image.sh [TAG]      # default hsstream-base:bookworm; needs root and mmdebstrap
set -euo pipefail
TAG="${1:-hsstream-base:bookworm}"
SUITE="${BASE_SUITE:-bookworm}"
ENGINE="${CONTAINER_ENGINE:-docker}"

if "$ENGINE" image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG already present"
    exit 0
fi
command -v mmdebstrap >/dev/null || {
    echo "make-base-image: mmdebstrap is missing: apt-get install mmdebstrap" >&2; exit 2; }
tarball="$(mktemp --suffix=.tar)"
trap 'rm -f "$tarball"' EXIT
# --variant=apt: essential + apt, nothing else; the docs and man pages go (a smaller image).
mmdebstrap --quiet --variant=apt --include=python3,python3-pip,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --aptopt='APT::Install-Recommends "false"' \
    "$SUITE" "$tarball"
"$ENGINE" import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' "$tarball" "$TAG" >/dev/null
echo "base image $TAG made from Debian $SUITE ($(du -h "$tarball" | cut -f1) tarball)"
