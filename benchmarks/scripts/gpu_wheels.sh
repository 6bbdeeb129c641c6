#!/usr/bin/env bash
# Fetches, on this (CPU) machine, the wheels river_hf needs on the project's offline NVIDIA H200 machine (its python3
# has torch 2.11 + CUDA 13, accelerate, peft, triton, pytest, but transformers 5.17 and no hqq or gguf), into
# .gpu-wheels/ (git-ignored, ~22 MB), for benchmarks/scripts/gpu_run.sh to install there. hqq and gemlite (the CUDA
# twin kernels' Triton GEMVs, pure Python on the machine's own triton) have no wheel: they are built from their sdists.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu-wheels
fetch() {
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d .gpu-wheels "$@"
}
fetch transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 gguf==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 \
    hf-xet==1.8.0 click==8.5.1 typer shellingham idna truststore termcolor
pip wheel -q --no-deps --no-build-isolation -w .gpu-wheels hqq==0.2.8.post1
pip wheel -q --no-deps -w .gpu-wheels gemlite==0.6.0.post2  # isolated: its setup.py builds with the `wheel` package
du -sh .gpu-wheels
