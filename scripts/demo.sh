#!/usr/bin/env bash
# The main job on the default spec: install, build the SmolLM2 CPU plan, answer a request.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
SPEC=${SPEC:-model_specs/smollm2-135m-cpu.yaml}
PLAN=plans/$(python -c "import sys,yaml;print(yaml.safe_load(open(sys.argv[1]))['name'])" "$SPEC")
kiln build "$SPEC"
kiln inspect "$PLAN"
kiln generate "$PLAN" "What is the capital of France?" --chat --max-tokens 48
