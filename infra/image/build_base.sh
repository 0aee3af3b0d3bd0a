#!/usr/bin/env bash
# A Debian bookworm base image made from Debian's own packages, for machines that reach a Debian
# mirror but no container registry (the Containerfile's default base, debian:bookworm-slim, is
# pulled from one). The result is the same thing that image is: a minbase bookworm without docs.
#
#   infra/image/build_base.sh [TAG]        # default localhost/sprawl-base:bookworm
#   just image --build-arg BASE=localhost/sprawl-base:bookworm
#
# Needs mmdebstrap (Debian's package) and podman or docker; runs as root (mmdebstrap's root mode)
# or unprivileged where user namespaces are allowed (its unshare mode).
set -euo pipefail

tag="${1:-localhost/sprawl-base:bookworm}"
# Where the packages come from: mmdebstrap's default (Debian's own mirror, with bookworm-updates and
# bookworm-security added), or DEBIAN_SOURCES, an apt sources file (one-line or deb822) naming a
# mirror of bookworm, e.g. this machine's own /etc/apt/sources.list.d/debian.sources.
sources=()
if [ -n "${DEBIAN_SOURCES:-}" ]; then sources=("$DEBIAN_SOURCES"); fi

engine="$(command -v podman || command -v docker || true)"
[ -n "$engine" ] || { echo "build_base: neither podman nor docker is installed" >&2; exit 1; }
command -v mmdebstrap >/dev/null || { echo "build_base: mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 1; }

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

# The same dpkg filter as the official slim images: no man pages, docs or translations, which a
# server image never reads (copyright files stay: they are the packages' licences).
mmdebstrap \
    --variant=minbase \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/*' \
    bookworm "$workdir/rootfs.tar" "${sources[@]}"

"$engine" import \
    --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$workdir/rootfs.tar" "$tag"
echo "build_base: $tag"
