#!/usr/bin/env bash
# The images' base for a machine that reaches no container registry (no python:3.11-slim to pull):
# Debian bookworm's minimal root with its own python3 (3.11, the images' Python), made by
# debootstrap from a Debian mirror and imported into the local image store. Made once: a machine
# that has the image already does nothing. Run as root (debootstrap, and buildah's store: hack/storage.conf).
#
#   bash hack/base-image.sh                 # -> localhost/sparrowrl-base:bookworm
#   BASE_IMAGE=... DEBIAN_MIRROR=... bash hack/base-image.sh
set -euo pipefail
IMAGE=${BASE_IMAGE:-localhost/sparrowrl-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
export CONTAINERS_STORAGE_CONF=${CONTAINERS_STORAGE_CONF:-$(cd "$(dirname "$0")" && pwd)/storage.conf}
BUILDAH=(buildah)

if "${BUILDAH[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1; then
  echo "base-image: $IMAGE is here already"
  exit 0
fi
for tool in debootstrap buildah; do
  command -v "$tool" >/dev/null || { echo "base-image: $tool is not installed (apt-get install $tool)" >&2; exit 1; }
done
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "base-image: debootstrap bookworm from $MIRROR (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" \
  >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# what an image does not need: the package lists and caches, docs, man pages, translations
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
  "$root"/var/log/*
ctr=$("${BUILDAH[@]}" from scratch)
"${BUILDAH[@]}" copy --quiet "$ctr" "$root" / >/dev/null
"${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd /bin/bash \
  --label org.opencontainers.image.description="Debian bookworm minbase with python3, by debootstrap" "$ctr"
"${BUILDAH[@]}" commit --quiet --rm "$ctr" "$IMAGE" >/dev/null
echo "base-image: $IMAGE, $("${BUILDAH[@]}" images --format '{{.Size}}' "$IMAGE")"
