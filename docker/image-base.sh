#!/usr/bin/env bash
# `make image-base`: a Debian bookworm base image with Python 3.11 from Debian packages, made with no
# image registry: debootstrap (Debian's package archive) into a folder, then `docker import`.
# Usage: docker/image-base.sh [IMAGE]   (default pipeshard-base:bookworm; FORCE=1 rebuilds)
set -euo pipefail
image="${1:-pipeshard-base:bookworm}"
suite="${SUITE:-bookworm}"
rootfs="${ROOTFS:-build/base-rootfs}"

docker info >/dev/null 2>&1 || {
    echo "error: no Docker daemon answers (start it: \`sudo systemctl start docker\` or \`sudo dockerd &\`)" >&2
    exit 1
}
if [[ -z "${FORCE:-}" ]] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "$image already exists (FORCE=1 rebuilds it)"
    exit 0
fi
command -v debootstrap >/dev/null || {
    echo "error: debootstrap is missing (install it: \`sudo apt-get install debootstrap\`)" >&2
    exit 1
}
[[ $(id -u) == 0 ]] || {
    echo "error: debootstrap needs root (run \`sudo make image-base\`)" >&2
    exit 1
}
start=$SECONDS
# A half-made folder from an interrupted run is made again, never imported.
if [[ ! -e "$rootfs/.complete" ]]; then
    rm -rf "$rootfs"
    mkdir -p "$(dirname "$rootfs")"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$rootfs"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    touch "$rootfs/.complete"
fi
tar -C "$rootfs" --exclude=./.complete -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    - "$image" >/dev/null
echo "$image built in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec))"
