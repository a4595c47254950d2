#!/usr/bin/env bash
# One call on a lent GPU machine (the `device` tool): checks, then times, the GPU kernel.
#   bash pallas_kernels/gpu_session.sh [tune]     (tune: also search block sizes, ~2 min more)
# Writes logs under $OUT (default ./gpu_out). Never stops early: each step reports, the next runs.
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee "$OUT/env.txt"
$PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/env.txt"
date -u +%FT%TZ | tee -a "$OUT/env.txt"
step() { echo "=== $1"; shift; "$@"; echo "=== rc $?"; }
# Kernel vs reference (float32 at full precision), vs upstream, and a model's greedy tokens end to end.
step tests timeout 600 env JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m pytest -q -n 0 -p no:cacheprovider \
  tests/test_pallas_kernels.py tests/test_pallas_kernels_gpu.py -k "gpu_kernel or model_with_the_pallas or mosaic_kernel_compiled" 2>&1 \
  | grep -v "DeprecationWarning\|return rule\|warnings$" | tee "$OUT/tests.log" | tail -15
bench() { $PY -m pallas_kernels.bench --variants copy,reference,ours,mosaic,upstream --repeats 20 --layers 8 "$@"; }
step bench bench --batch 8 --contexts 1024,4096,16384 2>&1 | tee "$OUT/bench.log"
step bench-b32 bench --batch 32 --contexts 4096 2>&1 | tee -a "$OUT/bench.log"
step bench-int8 bench --batch 8 --contexts 4096,16384 --kv-dtype int8 2>&1 | tee -a "$OUT/bench.log"
step bench-h64 bench --batch 16 --contexts 4096 --heads 16,16 --head-dim 64 2>&1 | tee -a "$OUT/bench.log"
step bench-window bench --batch 8 --contexts 16384 --window 4096 2>&1 | tee -a "$OUT/bench.log"  # reads the window only?
if [ "$1" = tune ]; then
  for shape in "--batch 8 --contexts 4096,16384" "--batch 32 --contexts 4096"; do
    step tune $PY -m pallas_kernels.tune_gpu $shape --repeats 10 2>&1 | tee -a "$OUT/tune.log" | grep -v "^ *[0-9]* {"
  done
fi
# End to end on the GPU: the 150M Llama preset (written by transformers), ours vs HF on the same GPU.
step e2e timeout 300 $PY -c "import sys; from jaxinfer.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench latency --preset llama-150m --dtype bfloat16 --batch-sizes 1,16,64 --vs-hf 2>&1 | tee "$OUT/e2e.log" | tail -30
