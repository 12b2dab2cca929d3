r"""The decoding loop's vocabulary-wide work: `specjax.sampling` against one
pass over the whole row.

Every step of every decoder picks tokens from [B, V] rows: the target's
next token (`sampling.probabilities`, then `sampling.sample`), each draft
token, and the draft's confidence. XLA's CPU argmax and cumsum over a row
are serial loops; `sampling.argmax` and `sampling.sample` search the row's
blocks of `sampling.BLOCK` tokens first. This times each against the
whole-row form (`jnp.argmax`; the inverse CDF by one `jnp.cumsum`), jitted,
on random rows, median of `--repeats` calls; the forms agree on every
draw they are given (checked here on the rows timed).

COMMAND:
  PYTHONPATH=. python scripts/bench_sampling.py --batches=1/8/32
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from specjax import hardware
from specjax import sampling

_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Rows B.")
_VOCAB = flags.DEFINE_integer("vocab", 151936, "V (Qwen2.5's by default).")
_REPEATS = flags.DEFINE_integer("repeats", 30, "Timed calls per function.")


def whole_row_sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """[B, V] -> [B]: the inverse CDF by one cumsum over the row."""
  cdf = jnp.cumsum(probs, axis=-1)
  u = jax.random.uniform(key, probs.shape[:-1] + (1,)) * cdf[..., -1:]
  return jnp.argmax(cdf > u, axis=-1).astype(jnp.int32)


def _median_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main(argv):
  del argv
  print(hardware.machine())
  key = jax.random.key(0)
  for batch in map(int, _BATCHES.value):
    logits = 4.0 * jax.random.normal(key, (batch, _VOCAB.value))
    probs = jax.nn.softmax(logits, axis=-1)
    pairs = {
        "argmax": (jax.jit(lambda x: jnp.argmax(x, axis=-1)),
                   jax.jit(sampling.argmax), (logits,)),
        "sample": (jax.jit(whole_row_sample), jax.jit(sampling.sample),
                   (key, probs)),
    }
    for name, (whole, blocked, args) in pairs.items():
      agree = np.array_equal(whole(*args), blocked(*args))
      old, new = _median_ms(whole, *args), _median_ms(blocked, *args)
      print(f"B={batch} V={_VOCAB.value} {name}: whole row {old:.2f} ms, "
            f"blocks {new:.2f} ms ({old / new:.1f}x); same tokens: {agree}",
            flush=True)


if __name__ == "__main__":
  app.run(main)
