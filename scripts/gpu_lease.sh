#!/bin/bash
# The checks a short GPU lease runs, in order of what they teach, each
# bounded so that what finished comes back (BENCHMARKS, "the first GPU
# lease": at the pair's full depth one crossover B did not compile within
# four minutes on an H100).
#
# On the device machine, from the repository root, with the wheels the
# image lacks (gguf, ml_collections) in .whl/ (see the device README):
#   bash scripts/gpu_lease.sh [seconds]
# Writes under $OUT (default /tmp/gpu_lease): env+smoke log, tests log,
# the plain-step figures, crossover JSON per B.
set -u
BUDGET=${1:-480}
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_lease}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 SPECJAX_CACHE=${SPECJAX_CACHE:-/tmp/sjcache}
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
LOG=$OUT/run.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', \
flax.__version__, jax.devices())"
} > "$LOG" 2>&1
# 1. Does it run here at all (tiny pair, every policy)?
timeout 150 python3 scripts/bench_crossover.py --weights=random \
  --target=tiny --draft=tiny --batches=2 --alphas=0.8 --gammas=2 \
  --tokens=16 --prompt_tokens=8 --repeats=1 --output_dir=/tmp/smoke \
  >> "$LOG" 2>&1 || { echo "smoke failed at $(elapsed)s"; tail -30 "$LOG";
                      exit 1; }
echo "smoke done at $(elapsed)s" | tee -a "$LOG"
# 2. The loop's fixed cost per step against a shallow forward: operations
# and time, the batch's end computed both ways (the GPU side of the
# trade `finish.expected_steps` makes).
for layers in -1 4; do
  timeout $(( $(left) / 3 )) python3 scripts/bench_plain_step.py \
    --num_layers=$layers --batch=1 --tokens=64 --prompt_tokens=16 \
    --repeats=15 --finish=serial,at_once --count_ops \
    >> "$OUT/plain_step.log" 2>&1
  echo "plain step, num_layers=$layers, rc=$? at $(elapsed)s" | tee -a "$LOG"
done
grep "ms/step" "$OUT/plain_step.log"
# 3. Exactness on the GPU (greedy against transformers, the enumeration
# tests), as long as a third of what is left allows.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( $(left) / 3 )) \
  python3 -m pytest -q -n 8 -p no:cacheprovider \
  -m "not real_models and not slow" tests/test_generate_hf.py \
  tests/test_speculative.py tests/test_distribution.py \
  tests/test_adaptive.py > "$OUT/tests.log" 2>&1
echo "tests rc=$? at $(elapsed)s" | tee -a "$LOG"
# 4. The crossover at the pair's shapes, one B per process, while time is
# left (each B compiles five programs of 28 unrolled layers).
for b in 1 8 32; do
  [ "$(left)" -lt 60 ] && break
  timeout "$(left)" python3 scripts/bench_crossover.py --weights=random \
    --batches=$b --alphas=0.05/0.8/0.95 --gammas=2/4 --tokens=64 \
    --prompt_tokens=16 --repeats=3 --timings=2 \
    --output_dir=/tmp/crossover_b$b >> "$LOG" 2>&1
  echo "crossover B=$b rc=$? at $(elapsed)s" | tee -a "$LOG"
  cp /tmp/crossover_b$b/crossover.json "$OUT/crossover_b$b.json" 2>/dev/null
done
echo "done at $(elapsed)s"
