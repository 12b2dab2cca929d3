r"""One matrix product per weight format: the CPU kernel against XLA, against
float32, and as a fraction of the machine's measured fp32 peak.

A [O, I] = [8960, 1536] matrix (the 1.5B target's MLP up projection) in
float32 and in each GGUF format the offline Qwen files use (random blocks,
`specjax.testing.random_blocks`), times X rows (1: a decode step, 9: a
verification pass at γ = 8, 64: a prefill chunk). Prints the best of 20
calls per format and path, in ms, with the bytes the product reads and
the implied GB/s: the kernel with float activations (exact), with int8
activations (`a8`, llama.cpp's arithmetic; AMX tiles from 12 rows where
`kernels.amx()`, off with SPECJAX_NO_AMX=1), and XLA. The peak is XLA's
fp32 dot at [2048, 2048] x [2048, 2048] (compute-bound, in cache); each
row also gives XLA's fp32 dot of its own shape, and each kernel's
GFLOP/s as a fraction of the peak (`of_peak`).

One matrix called again stays in the cache, which a model's forward never
sees: with `--streamed=L` each format also runs L different matrices of
the shape in one jitted call, as a forward's layers run them, and reports
the mean ms a matrix from memory (`streamed_ms`, `streamed_a8_ms`: 24
matrices of Q4_K are 191 MB, beyond any L3).

COMMAND: [SPECJAX_NO_AMX=1] python scripts/bench_quant_kernel.py \
  [--rows=1,9,64] [--streamed=24]
"""

from __future__ import annotations

import argparse
import json
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu
from specjax import hardware
from specjax.checkpoints import gguf_blocks
from specjax.cpu import kernels
from specjax.models import quantized
from specjax.testing import random_blocks

O, I = 8960, 1536
Q = gguf.GGMLQuantizationType


def _best_ms(fn, *args, calls: int = 20) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return 1e3 * best


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", default="1,9,64")
  parser.add_argument("--streamed", type=int, default=0,
                      help="also time this many different matrices a call")
  args = parser.parse_args()

  def blocks(qtype, seed=0):
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return jax.tree.map(jnp.asarray, gguf_blocks.from_blocks(
        random_blocks(qtype, O, I // block, seed), qtype, "bench", (I, O)))

  qtypes = (Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0)
  matrices = {qtype.name: blocks(qtype) for qtype in qtypes}
  stacks = {qtype.name: [matrices[qtype.name]] + [
      blocks(qtype, seed) for seed in range(1, args.streamed)]
            for qtype in qtypes} if args.streamed > 1 else {}
  dense = jnp.asarray(np.random.default_rng(0).normal(
      size=(O, I)).astype(np.float32))
  kernel = jax.jit(lambda x, w: quantized.matmul(x, w, kernel=cpu.SMALLM))
  # Every matrix of a list in one call (a column of each output kept).
  each = jax.jit(lambda x, ws: [
      quantized.matmul(x, w, kernel=cpu.SMALLM)[:, 0] for w in ws])
  xla = jax.jit(quantized.matmul)
  dot = jax.jit(lambda x, w: x @ w.T)
  square = jnp.ones((2048, 2048), jnp.float32)
  peak = 2 * 2048 ** 3 / _best_ms(dot, square, square, calls=5) / 1e6
  print(json.dumps({"cpu": hardware.cpu_id(), "jax": jax.__version__,
                    "shape": [O, I], "kernels": kernels.available(),
                    "amx": kernels.amx(), "peak_GFLOP_per_s": round(peak)}))
  for rows in (int(r) for r in args.rows.split(",")):
    x = jax.random.normal(jax.random.key(rows), (rows, I), jnp.float32)
    # float32's own path: the kernel up to its row limit, XLA's dot above
    # (a prefill chunk; the quantized kernel runs pieces of MAX_ROWS).
    gemm = _best_ms(dot, x, dense)
    fp32 = (_best_ms(jax.jit(kernels.smallm_matmul), x, dense)
            if rows <= kernels.MAX_ROWS else gemm)
    gflop = 2 * rows * O * I / 1e9
    print(json.dumps({"rows": rows, "format": "float32", "bytes": dense.nbytes,
                      "kernel_ms": round(fp32, 3),
                      "GB_per_s": round(dense.nbytes / fp32 / 1e6, 1),
                      "of_peak": round(gflop / fp32 * 1e3 / peak, 3),
                      "xla_dot_ms": round(gemm, 3),
                      "xla_dot_of_peak": round(gflop / gemm * 1e3 / peak, 3)}))
    for name, w in matrices.items():
      ms = _best_ms(kernel, x, w)
      a8 = _best_ms(kernel, x, w.replace(act_bits=8))
      streamed = {}
      if name in stacks:
        ws = stacks[name]
        streamed = {
            "streamed_ms": round(_best_ms(each, x, ws, calls=5) / len(ws), 3),
            "streamed_a8_ms": round(_best_ms(each, x, [
                v.replace(act_bits=8) for v in ws], calls=5) / len(ws), 3)}
      print(json.dumps({
          "rows": rows, "format": name, "bytes": w.nbytes, **streamed,
          "kernel_ms": round(ms, 3), "kernel_a8_ms": round(a8, 3),
          "xla_ms": round(_best_ms(xla, x, w), 3),
          "GB_per_s": round(w.nbytes / ms / 1e6, 1),
          "of_peak": round(gflop / ms * 1e3 / peak, 3),
          "a8_GB_per_s": round(w.nbytes / a8 / 1e6, 1),
          "kernel_over_float32": round(ms / fp32, 3),
          "a8_over_float32": round(a8 / fp32, 3)}), flush=True)


if __name__ == "__main__":
  main()
