"""Times a user's first calls: the same call four times in one fresh process.

A user loads a pair, then calls `generate` or `speculative_generate` again
and again. The first call compiles; every later call should cost what the
steady state costs. This script builds a random pair at real shapes (the
target at Qwen2.5-Coder-0.5B's, the draft the same shapes cut to a few
layers), then makes the same call `--calls` times in a row and prints each
call's wall time. Acceptance is SYNTHETIC (`synthetic_acceptance`), since
random weights accept nothing: label the figures so.

Run one API per process (what a user's process does), e.g.:

  for api in generate auto; do for b in 1 16; do
    python scripts/bench_user_calls.py --api=$api --batch=$b --alpha=0.05
  done; done

With `SPECJAX_CACHE` pointing at a fresh folder the first call also
compiles from nothing, as on a new machine.
"""

from __future__ import annotations

import dataclasses
import json
import time

from absl import app
from absl import flags
import jax
import numpy as np

from specjax import decode
from specjax import hardware
from specjax import models

_API = flags.DEFINE_enum("api", "auto", ["generate", "auto", "fixed"],
                         "generate, speculative_generate(gamma='auto'), or "
                         "a fixed --gamma.")
_BATCH = flags.DEFINE_integer("batch", 1, "B, rows per call.")
_ALPHA = flags.DEFINE_float("alpha", 0.05, "Synthetic acceptance rate.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "γ for --api=fixed; γ_max for "
                              "auto.")
_TOKENS = flags.DEFINE_integer("tokens", 64, "max_new_tokens per call.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 32, "Prompt length.")
_CALLS = flags.DEFINE_integer("calls", 4, "Calls in a row.")
_DRAFT_LAYERS = flags.DEFINE_integer("draft_layers", 4,
                                     "Layers of the draft model.")
_JSON = flags.DEFINE_string("json", "", "Also write the figures here.")

# Qwen2.5-Coder-0.5B-Instruct's shapes (its config.json).
SHAPES = models.ModelConfig(
    arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
    qkv_bias=True, tie_embeddings=True)


def main(argv):
  del argv
  target = models.init_random(SHAPES, jax.random.key(0))
  draft = models.init_random(
      dataclasses.replace(SHAPES, num_layers=_DRAFT_LAYERS.value),
      jax.random.key(1))
  rng = np.random.default_rng(_BATCH.value)
  prompts = rng.integers(1, 1000, (_BATCH.value, _PROMPT.value)).tolist()
  kwargs = dict(max_new_tokens=_TOKENS.value)
  if _API.value == "generate":
    call = lambda: decode.generate(target, prompts, **kwargs)
  else:
    gamma = "auto" if _API.value == "auto" else _GAMMA.value
    call = lambda: decode.speculative_generate(
        target, draft, prompts, gamma=gamma, max_gamma=_GAMMA.value,
        synthetic_acceptance=_ALPHA.value, **kwargs)
  seconds = []
  for _ in range(_CALLS.value):
    start = time.perf_counter()
    out = call()
    jax.block_until_ready(out.tokens)
    seconds.append(time.perf_counter() - start)
    print(f"call {len(seconds)}: {seconds[-1]:.2f} s", flush=True)
  record = {"api": _API.value, "batch": _BATCH.value, "alpha": _ALPHA.value,
            "gamma": _GAMMA.value, "tokens": _TOKENS.value,
            "prompt_tokens": _PROMPT.value, "seconds": seconds,
            "machine": hardware.machine(), "jax": jax.__version__}
  print(json.dumps(record))
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  app.run(main)
