"""Peak memory of one large-batch call, and the law of its samples.

The tiny random pair (vocabulary 8), one 5-token prompt repeated B times,
N = 2, γ = 3, T = 1: `speculative_generate` in a fresh process, as a user
checking the sampler's law with many rows runs it. Prints the process's
peak RSS and a chi-square test of the B samples against the target's
exact joint law of the two tokens, enumerated from one causal forward per
continuation.

  python scripts/bench_batch_memory.py --batch=24000
"""

from __future__ import annotations

import resource
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from specjax import decode
from specjax import hardware
from specjax import models
from specjax import testing

_BATCH = flags.DEFINE_integer("batch", 24_000, "Rows B.")
_CACHE = flags.DEFINE_integer(
    "cache_size", None, "S; default the call's own (`padding.cache_class`).")
_VOCAB = 8
_PROMPT = [1, 2, 3, 4, 5]
_TOKENS = 2


def _model(config, seed: int) -> models.Model:
  """A random tiny model whose logits spread over a few nats."""
  m = models.init_random(config.replace(vocab_size=_VOCAB),
                         jax.random.key(seed))
  return m.replace(params=dict(m.params, lm_head=m.params["lm_head"] * 10.0))


def _exact_joint(target: models.Model) -> np.ndarray:
  """[V, V] P(first two tokens) at T = 1, by enumeration."""
  texts = np.array([_PROMPT + [a] for a in range(_VOCAB)], np.int32)
  out, _ = target(jnp.asarray(texts), target.init_cache(_VOCAB, 16))
  logits = np.asarray(out.logits, np.float64)  # [V, P+1, V]
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return probs[0, len(_PROMPT) - 1][:, None] * probs[:, len(_PROMPT)]


def main(argv):
  del argv
  target = _model(testing.TINY_TARGET, 0)
  draft = _model(testing.TINY_DRAFT, 1)
  batch = _BATCH.value
  start = time.perf_counter()
  out = decode.speculative_generate(
      target, draft, [_PROMPT] * batch, gamma=3, max_new_tokens=_TOKENS,
      temperature=1.0, key=0, cache_size=_CACHE.value)
  seconds = time.perf_counter() - start
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB
  tokens = np.asarray(out.tokens[:, :_TOKENS])
  joint = _exact_joint(target)
  seen = np.bincount(tokens[:, 0] * _VOCAB + tokens[:, 1],
                     minlength=_VOCAB**2)
  expected = joint.ravel() * batch
  keep = expected >= 5  # chi-square's usual validity rule
  chi2 = float((((seen - expected) ** 2 / expected)[keep]).sum())
  critical = float(stats.chi2.ppf(0.999, keep.sum() - 1))
  machine = hardware.machine()
  print(f"CPU: {machine['cpu_model']} ({machine['cpu_simd']}); JAX "
        f"{jax.__version__}")
  print(f"B = {batch}, S = {_CACHE.value or 'default'}: {seconds:.1f} s, "
        f"peak RSS {rss:.2f} GiB; chi-square {chi2:.1f} against "
        f"{critical:.1f} (p = 0.001, {int(keep.sum()) - 1} dof): "
        f"{'PASS' if chi2 < critical else 'FAIL'}")


if __name__ == "__main__":
  app.run(main)
