#!/usr/bin/env bash
# One-shot GPU check of dcr's CUDA kernels: the GPU tests, then the benchmark.
#   benches/gpu/run_gpu_check.sh [OUTDIR]     (default bench-out/)
# Writes OUTDIR/gpu_tests.txt, OUTDIR/bench.txt, OUTDIR/kernels.json.
# About 3-6 minutes on an H100/H200, most of it NVRTC compiles (each tuning
# setting once; the default setting is cached in ~/.cache/dcr/cuda).
# Exit 0 only if both passed.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
out="${1:-bench-out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "nvidia-smi not available"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
python - <<'PY'
import time, dcr.cuda as dc
t = time.perf_counter()
print("kernels from", dc.load_kernels(), f"in {time.perf_counter() - t:.1f} s")
PY
timeout 420 python -m pytest tests/test_cuda_kernels.py -m gpu -q --maxfail=20 -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt"
t=${PIPESTATUS[0]}
timeout 420 python benches/gpu/bench_kernels.py --out "$out/kernels.json" 2>&1 | tee "$out/bench.txt"
b=${PIPESTATUS[0]}
echo "gpu tests rc=$t, bench rc=$b"
[ "$t" -eq 0 ] && [ "$b" -eq 0 ]
