#!/usr/bin/env bash
# Every CUDA check of the project in one short script for a GPU machine (issue 35): the CUDA tests, then the GPU bench
# (bench/bench_gpu.py). About four minutes on one H200. Results go to $OUT (default: bench/gpu-out/).
# Usage: bash bench/gpu_check.sh COMMIT   (the commit measured: the device's copy of the tree has no .git)
# Where a package is missing (fastcore), put it under .gpu/site: it goes on PYTHONPATH.
set -o pipefail
OUT=${OUT:-bench/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=$(command -v python3)
nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 170 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py tests/test_model_properties.py -k "cuda" 2>&1 | tee "$OUT/cuda-tests.log"
echo "cuda tests rc=$?"
timeout 300 $PY bench/bench_gpu.py --budget 200 --commit "${1:-unknown}" --out "$OUT/results-gpu.json" 2>&1 | grep -v "it/s\|s/it" | tee "$OUT/bench-gpu.log"
echo "bench rc=$?"
