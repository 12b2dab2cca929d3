r"""Profiles a target forward and a verification pass, by operation class.

For each matmul plan, times one jitted forward of 1 token and of γ+1 tokens
per row (after a prefill, so attention reads a realistic cache) and splits
the time into `specjax.profiling.CLASSES` from a `jax.profiler` trace.

COMMAND: python scripts/profile_verify.py \
  --model=qwen2.5-coder-1.5b-instruct --plans=in_out/xla,out_in/kernel

Prints a table (CPU ms per call by class; thunks of two threads overlap, so
columns add up to more than the wall time) and writes --output as JSON.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax.numpy as jnp

from specjax import cpu
from specjax import hardware
from specjax import profiling
from specjax import registry
from specjax import testing
from specjax.tuning import cost

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-1.5b-instruct",
                             "Registry name, path, or 'tiny'.")
_PLANS = flags.DEFINE_list("plans", ["in_out/xla", "out_in/kernel"],
                           "Matmul plans to profile.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Verify γ+1 tokens per row.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 150, "Cached tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Traced calls per step.")
_OUTPUT = flags.DEFINE_string("output", "", "JSON output file.")


def main(argv):
  del argv
  if _MODEL.value == "tiny":
    model, _ = testing.tiny_pair()
  else:
    model, _ = registry.load_pretrained(_MODEL.value)
  prompts = [[(7 * i) % 100 + 1 for i in range(_PROMPT.value)]]
  cache_size = 512
  results = {"machine": hardware.machine(), "model": _MODEL.value,
             "gamma": _GAMMA.value, "plans": {}}
  for plan in _PLANS.value:
    m = model.with_plan(cpu.plan(plan))
    for tokens in (1, _GAMMA.value + 1):
      step = cost.forward_step(m, prompts, cache_size, tokens)
      step()
      cache = m.init_cache(1, cache_size)
      hlo = cost.compiled_forward_hlo(m, jnp.zeros((1, tokens), jnp.int32),
                                      cache)
      out = profiling.profile_step(step, hlo, _REPEATS.value)
      results["plans"].setdefault(plan, {})[f"T={tokens}"] = out
      cells = "  ".join(f"{c} {v:7.1f}" for c, v in
                        out["classes_ms"].items() if v >= 0.05)
      print(f"{plan:14s} T={tokens}: wall {out['wall_ms']:7.1f} ms | {cells}",
            flush=True)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
