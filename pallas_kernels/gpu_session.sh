#!/usr/bin/env bash
# One call on a lent GPU machine (the `device` tool): checks, then times, the GPU kernels.
#   bash pallas_kernels/gpu_session.sh [STEP ...]    steps: tests tune bench prefill e2e (default: tests bench e2e)
# tests: the Triton and Mosaic GPU kernels compiled, against the reference, upstream, and a model's greedy
# tokens (~3 min on an H200); tune: block search on three decode shapes (~3 min); bench: the kernels against a
# copy and upstream (~2 min); prefill: chunks of prefill, Triton against Mosaic (~1 min); e2e: the 150M Llama
# against transformers on the same GPU (~2 min).
# Writes logs under $OUT (default ./gpu_out). Never stops early: each step reports, the next runs.
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PY=${PY:-python3}
steps=${*:-tests bench e2e}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee "$OUT/env.txt"
$PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/env.txt"
date -u +%FT%TZ | tee -a "$OUT/env.txt"
step() { echo "=== $1 $(date -u +%T)"; shift; "$@"; echo "=== rc $?"; }
has() { [[ " $steps " == *" $1 "* ]]; }
if has tests; then  # float32 at full precision; the Mosaic variant in bf16/f16
  step tests timeout 240 env JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m pytest -q -n 0 -p no:cacheprovider --tb=short \
    tests/test_pallas_kernels.py tests/test_pallas_kernels_gpu.py -k "${TESTS_K:-gpu_kernel or model_with_the_pallas or mosaic_kernel_compiled}" 2>&1 \
    | grep -v "DeprecationWarning\|return rule\|warnings$" > "$OUT/tests.log"; tail -25 "$OUT/tests.log"
fi
if has tune; then
  IFS=';' read -ra shapes <<< "${TUNE_SHAPES:---batch 8 --contexts 4096;--batch 32 --contexts 4096;--batch 8 --contexts 16384}"
  for shape in "${shapes[@]}"; do  # TUNE_SHAPES: ';'-separated tune_gpu flags
    step tune timeout 150 $PY -m pallas_kernels.tune_gpu $shape --layers 8 --repeats 10 2>&1 | tee -a "$OUT/tune.log"
  done
fi
if has bench; then
  bench() { timeout 120 $PY -m pallas_kernels.bench --variants copy,ours,mosaic,upstream --repeats 20 --layers 8 "$@"; }
  step bench bench --batch 8 --contexts 4096,16384 2>&1 | tee "$OUT/bench.log"
  step bench-b32 bench --batch 32 --contexts 4096 2>&1 | tee -a "$OUT/bench.log"
  step bench-int8 bench --batch 8 --contexts 16384 --kv-dtype int8 2>&1 | tee -a "$OUT/bench.log"
  step bench-h64 bench --batch 16 --contexts 4096 --heads 16,16 --head-dim 64 2>&1 | tee -a "$OUT/bench.log"
  step bench-h256 bench --batch 8 --contexts 4096,16384 --heads 16,8 --head-dim 256 2>&1 | tee -a "$OUT/bench.log"
fi
if has prefill; then  # chunks of prefill: the dispatch sends them to Triton until the Mosaic kernel is timed faster
  prefill() { timeout 120 $PY -m pallas_kernels.bench --variants ours,mosaic --repeats 20 --layers 8 "$@"; }
  step prefill prefill --batch 8 --contexts 4096 --query-len 64 2>&1 | tee "$OUT/prefill.log"
  step prefill-512 prefill --batch 4 --contexts 4096 --query-len 512 2>&1 | tee -a "$OUT/prefill.log"
  step prefill-h256 prefill --batch 4 --contexts 4096 --query-len 512 --heads 16,8 --head-dim 256 2>&1 \
    | tee -a "$OUT/prefill.log"
fi
if has e2e; then  # the 150M Llama preset (written by transformers), ours vs HF on the same GPU
  step e2e timeout 300 $PY -c "import sys; from jaxinfer.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench latency --preset llama-150m --dtype bfloat16 --batch-sizes 1,16,64 --vs-hf 2>&1 | tee "$OUT/e2e.log" | tail -30
fi
