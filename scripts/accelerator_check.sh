#!/bin/bash
# The accelerator check: one prepared run that fits a short GPU or TPU lease
# (at most 8 minutes on one H100/H200) with no network and no model files.
# Random weights at real shapes, synthetic acceptance; everything goes as
# JSON to the folder named first on the command line (see
# scripts/accelerator_check.py for what is measured).
#
#   bash scripts/accelerator_check.sh OUT_DIR [--tiny] [driver flags]
#
# --tiny (or SPECJAX_CHECK_TINY=1) runs the same code paths at tiny shapes
# on the CPU in well under two minutes (tests/test_accelerator_check.py,
# run before a lease: pytest -m extended).
#
# Wheels to carry: the machine has no network. specjax imports jax, jaxlib
# and the CUDA plugin (jax[cuda12]: usually in the image), numpy,
# ml_dtypes, opt_einsum, flax and what flax imports (msgpack, rich,
# pygments, pyyaml, typing_extensions, etils, treescope, optax), tqdm,
# filelock and absl-py. Put the wheels the image lacks, built for its
# Python, in .whl/ at the repository root (e.g. `pip download --no-deps
# -d .whl flax==X tqdm filelock ...` on a machine with network); they are
# installed with --no-index into /tmp/site. Nothing else is downloaded.
set -u
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: $0 OUT_DIR [--tiny] [flags of accelerator_check.py]" >&2
  exit 2
fi
OUT_DIR=$1
shift
START=$(date +%s)
mkdir -p "$OUT_DIR" || exit 1
cd "$(dirname "$0")/.." || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
fi
# First-call figures mean a fresh compile: no persistent compilation cache.
export PYTHONUNBUFFERED=1 SPECJAX_NO_COMPILE_CACHE=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# At tiny shapes compiling dominates: XLA's CPU backend at LLVM -O0, as in
# the tests (speed changes, results do not).
if [[ " $* " == *" --tiny "* ]] || [ -n "${SPECJAX_CHECK_TINY:-}" ]; then
  case "${XLA_FLAGS:-}" in
    *xla_backend_optimization_level*) ;;
    *) export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0" ;;
  esac
fi
{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi \
    --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
} > "$OUT_DIR/environment.txt" 2>&1
# 8 minutes in all: the driver starts no measurement past its budget, and
# the timeout ends one that overruns (what finished is already written).
timeout 470 python3 scripts/accelerator_check.py "$OUT_DIR" "$@" \
  2>&1 | tee "$OUT_DIR/run.log"
RC=${PIPESTATUS[0]}
echo "accelerator check rc=$RC in $(( $(date +%s) - START )) s" \
  | tee -a "$OUT_DIR/run.log"
exit "$RC"
