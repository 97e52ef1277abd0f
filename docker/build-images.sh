#!/usr/bin/env bash
# `make image`: the serving image (pipeshard:latest) and the exporter image (pipeshard-exporter:latest)
# from the wheelhouse, with no registry and no package index. BASE=IMAGE picks the base image; unset:
# python:3.11-slim when it is present or can be pulled, else pipeshard-base:bookworm (`make image-base`).
set -euo pipefail
python="${PYTHON:-.venv/bin/python}"
wheelhouse=build/wheelhouse
docker info >/dev/null 2>&1 || {
    echo "error: no Docker daemon answers (start it: \`sudo systemctl start docker\` or \`sudo dockerd &\`)" >&2
    exit 1
}
for image in serving exporter; do
    "$python" docker/wheelhouse.py check "$wheelhouse" "$image" >/dev/null
done
"$python" docker/wheelhouse.py check-project build/project
base="${BASE:-}"
if [[ -z "$base" ]]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1 ||
        timeout 20 docker pull -q python:3.11-slim >/dev/null 2>&1; then
        base=python:3.11-slim
    else
        echo "no registry reachable: the base image comes from Debian packages (make image-base)"
        docker/image-base.sh pipeshard-base:bookworm
        base=pipeshard-base:bookworm
    fi
fi
for target in serving exporter; do
    tag=$([[ $target == serving ]] && echo pipeshard:latest || echo pipeshard-exporter:latest)
    start=$SECONDS
    DOCKER_BUILDKIT=0 docker build -q -f docker/Dockerfile --build-arg "BASE=$base" --target "$target" \
        -t "$tag" . >/dev/null 2> >(grep -v "DEPRECATED\|legacy builder\|BuildKit\|buildx\|^ *$" >&2)
    size=$(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec)
    echo "$tag built on $base in $((SECONDS - start)) s: $size"
done
