"""Times the expert products of a mixture-of-experts layer per strategy
(`specjax.models.moe`): a loop over the distinct chosen experts (XLA's
dots, and the CPU kernel reading each expert in place, `loop+kernel`),
the same loop over only each expert's rows (`grouped`, `grouped+kernel`),
gathering each (token, slot)'s expert, every expert densely, and
`jax.lax.ragged_dot` over tokens sorted by expert, at chunk sizes from a
decode step to a prefill chunk.

Shape letters: N token rows, E hidden, F expert MLP size, X experts, k
experts per token.

COMMAND: JAX_PLATFORMS=cpu python scripts/bench_moe.py [--repeats 5]
  [--quantize int4] [--rows 1,5,16]

Prints the CPU, the jax version, and per shape and N the median ms of each
strategy (and what `moe.strategy` picks). Random weights and router
logits (labelled: no trained router). `--quantize` packs the experts
("int8", "int4", `quantized.QuantSpec`): the loop then dequantises each
chosen expert in XLA, or the kernel reads its packed rows.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu
from specjax.cpu import kernels
from specjax.models import moe
from specjax.models import quantized
from specjax.models.config import EXPERT_PARAMS
from specjax.models.config import experts_out_in
from specjax.models.config import ModelConfig

# (name, E, F, X, k): a Mixtral-like layer and a Qwen3-MoE-like one, both
# scaled down to fit a 2-core machine.
SHAPES = (("mixtral-like", 1024, 3584, 8, 2),
          ("qwen3-moe-like", 1024, 384, 64, 8))
ROWS = (1, 5, 16, 64, 128, 256, 512)
# Skip a gather whose copies would exceed this many bytes.
GATHER_LIMIT = 3 << 30


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def _median_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--quantize", default="")
  parser.add_argument("--rows", default=",".join(map(str, ROWS)))
  args = parser.parse_args()
  spec = args.quantize and quantized.QuantSpec.parse(args.quantize)
  print(f"CPU: {_cpu_name()}; backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s); jax {jax.__version__}; float32"
        f" activations, {args.quantize or 'float32'} experts")
  for name, e, f, x, k in SHAPES:
    config = ModelConfig(arch="qwen3_moe", vocab_size=8, hidden_size=e,
                         intermediate_size=f, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=8, num_experts=x,
                         num_experts_per_tok=k, norm_topk_prob=True)
    keys = jax.random.split(jax.random.key(0), 5)
    stacks = [0.02 * jax.random.normal(key, (x, f, e)) for key in keys[:3]]
    if spec:  # each expert packed as its [out, in] matrix (down [E, F])
      stacks = [jax.tree.map(jnp.asarray, quantized.quantize_stack(
          experts_out_in(np.asarray(w), param), spec, param,
          shape=(x, f, e))) for w, param in zip(stacks, EXPERT_PARAMS)]
    ws = moe.Experts(*stacks)
    expert_bytes = sum(a.nbytes for w in stacks
                       for a in jax.tree.leaves(w)) // x
    print(f"\n{name}: E={e} F={f} X={x} k={k}, "
          f"{x * expert_bytes / 2**20:.0f} MiB of experts")
    runs = [(how, None) for how in moe.STRATEGIES]
    if kernels.available():
      runs[2:2] = [("loop", cpu.SMALLM), ("grouped", cpu.SMALLM)]
    print(f"{'N':>5} " + " ".join(
        f"{how + ('+kernel' if kernel else ''):>11}" for how, kernel in runs)
          + "  picks")
    for rows in map(int, args.rows.split(",")):
      h = jax.random.normal(keys[3], (rows, e))
      logits = jax.random.normal(keys[4], (rows, x))
      cells = []
      for how, kernel in runs:
        if how == "gather" and rows * k * expert_bytes > GATHER_LIMIT:
          cells.append(f"{'-':>11}")
          continue
        fn = jax.jit(lambda h, l, ws, how=how, kernel=kernel:
                     moe.apply_experts(h, l, ws, config, how, kernel)[0])
        ms = _median_ms(fn, h, logits, ws, repeats=args.repeats)
        cells.append(f"{ms:11.2f}")
      print(f"{rows:>5} {' '.join(cells)}  {moe.strategy(rows)}")


if __name__ == "__main__":
  main()
