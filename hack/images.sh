#!/usr/bin/env bash
# `make images`: the runtime image (cpu, or gpu) and the operator image, from runtime/Dockerfile and
# operator/Dockerfile, with docker where its daemon answers, else with buildah (as root). Where no
# registry can be reached, the base is Debian's own (hack/base-image.sh, made once); where
# PyTorch's index cannot, torch's CPU build comes from a local index of this machine's pip
# configuration, mounted into the build.
#
#   RUNTIME_IMAGE=... OPERATOR_IMAGE=... [CONTAINER=docker|podman|buildah] hack/images.sh [cpu|gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
variant=${1:-cpu}
: "${RUNTIME_IMAGE:?}"
[ "$variant" = gpu ] || : "${OPERATOR_IMAGE:?}"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/hack/containers.conf}
export CONTAINERS_STORAGE_CONF=${CONTAINERS_STORAGE_CONF:-$PWD/hack/storage.conf}
tool=${CONTAINER:-}
if [ -n "$tool" ] && ! command -v "$tool" >/dev/null; then
  echo "images: $tool is not installed; CONTAINER=docker, podman or buildah builds the same images" >&2
  exit 1
elif [ -z "$tool" ]; then
  if docker info >/dev/null 2>&1; then tool=docker
  elif command -v buildah >/dev/null; then tool=buildah
  else echo "images: neither a docker daemon nor buildah here (apt-get install buildah podman runc debootstrap)" >&2; exit 1
  fi
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || revision=$revision-dirty
# labels on the command line, not build arguments: a cached LABEL step keeps an older commit's
args=(--label "org.opencontainers.image.version=$version" --label "org.opencontainers.image.revision=$revision")
# the origin's https URL, without what a CI clone puts before the host (https://user:token@host/...)
source=$(git remote get-url origin 2>/dev/null | sed -E 's#^(https://)[^/@]*@#\1#' || true)
[[ $source == https://* ]] && args+=(--label "org.opencontainers.image.source=$source")
case $tool in
  docker) build=(env DOCKER_BUILDKIT=1 docker build) ;;  # BuildKit builds only the stages a target needs
  podman) build=(podman build --isolation chroot --network host --layers) ;;
  buildah) build=(buildah bud --isolation chroot --network host --layers) ;;
  *) echo "images: CONTAINER is docker, podman or buildah, not $tool" >&2; exit 1 ;;
esac

if [ "$tool" != docker ]; then
  # the Dockerfiles' base, unless no registry answers: then Debian's, by debootstrap
  base=$(sed -n 's/^ARG BASE=//p' runtime/Dockerfile)
  if ! timeout 60 "$tool" pull --quiet "docker.io/library/$base" >/dev/null 2>&1; then
    echo "images: NOTE: no registry answers for $base: building on Debian bookworm's own root and python3" \
      "(hack/base-image.sh), not on $base" >&2
    bash hack/base-image.sh
    args+=(--build-arg BASE=localhost/sparrowrl-base:bookworm)
  fi
  # a TLS proxy's CA, where pip is configured with one: the build's pip trusts it too
  cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
  [ -f "$cert" ] && args+=(--volume "$cert:/run/sparrowrl-ca.crt:ro" --build-arg PIP_CERT=/run/sparrowrl-ca.crt)
  # torch's CPU build, from a local folder or index of pip's configuration where PyTorch's index does not answer
  if [ "$variant" = cpu ] && ! curl -sf --max-time 20 -o /dev/null https://download.pytorch.org/whl/cpu/torch/; then
    torch=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml | head -1)
    config=$(python3 -m pip config list 2>/dev/null)
    found=
    for url in $(sed -n "s/.*find-links='\(.*\)'/\1/p" <<<"$config" | tr ' ' '\n' | sort -u); do
      if compgen -G "${url#file://}/torch-$torch+cpu-*.whl" >/dev/null; then
        found=(--build-arg "TORCH_FROM=--find-links ${url#file://}" --volume "${url#file://}:${url#file://}:ro")
        break
      fi
    done
    for url in $(sed -n "s/.*index-url='\(.*\)'/\1/p" <<<"$config" | tr ' ' '\n'); do
      [ -z "$found" ] || break
      if [[ $url == file://* ]] && compgen -G "${url#file://}/torch/torch-$torch+cpu-*" >/dev/null; then
        found=(--build-arg "TORCH_FROM=--index-url $url" --volume "${url#file://}:${url#file://}:ro")
      fi
    done
    [ -n "$found" ] || { echo "images: PyTorch's index does not answer, and pip's configuration names no folder with torch $torch+cpu" >&2; exit 1; }
    echo "images: torch $torch+cpu: ${found[1]#TORCH_FROM=}"
    args+=("${found[@]}")
  fi
fi
"${build[@]}" "${args[@]}" --target "$variant" -f runtime/Dockerfile -t "$RUNTIME_IMAGE" .
[ "$variant" = gpu ] || "${build[@]}" "${args[@]}" -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
