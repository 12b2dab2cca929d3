"""The draft cost ratio c: timed single forwards of each model.

Shape letters: B batch, P padded prompt, S cache size, T tokens per forward.

c = (median time of one jitted single-token decode step of the draft) /
(the same for the target), on the same B prompts, prefilled so attention
reads a warm cache of realistic length. The cache is donated and rolled back
inside the step, so repeats neither copy nor grow it. The target's
verification pass (T = γ+1 tokens) is timed the same way: Leviathan et al.'s
predicted speedup assumes it costs one target forward. Separate calls
include a dispatch overhead the compiled decoding loop does not pay; it is
negligible for real models and dominant for tiny ones.

The memory-bandwidth roofline of a decode step is the target's weight bytes
per token divided by the bandwidth of a large-array read (a jitted sum over
`_READ_BYTES`), timed in the same round-robin as the forwards.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specjax import decode

__all__ = ["forward_step", "measure_cost", "median_ms", "read_step"]

_READ_BYTES = 1 << 30


@functools.partial(jax.jit, donate_argnums=(2,))
def _forward(model, tokens, cache):
  """tokens [B, T] at the cache's lengths -> [B] argmax; cache unchanged."""
  start = cache.lengths
  logits, cache = model(tokens, cache)  # [B, T, V]
  return jnp.argmax(logits[:, -1], -1), cache.rollback(start)


@jax.jit
def _prefill(model, tokens, lengths, cache):
  return model.prefill(tokens, lengths, cache)


def forward_step(model: Any, prompts: Sequence[Sequence[int]],
                 cache_size: int, num_tokens: int) -> Callable[[], jax.Array]:
  """A callable running one jitted forward of `num_tokens` tokens per row.

  Args:
    model: a `LanguageModel`.
    prompts: B prompts; they are prefilled first, so attention reads a warm
      cache of realistic length.
    cache_size: S.
    num_tokens: T (1 for a decode step, γ+1 for a verification pass).

  Returns:
    A function of no arguments returning the step's [B] argmax tokens; each
    call donates the cache and gets it back rolled back, unchanged.
  """
  tokens, lengths, _ = decode.prepare_prompts(
      prompts, model.vocab_size, max_new_tokens=1, cache_size=cache_size)
  tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)  # [B, P], [B]
  _, cache = _prefill(model, tokens, lengths,
                      model.init_cache(tokens.shape[0], cache_size))
  chunk = jnp.broadcast_to(tokens[:, :1], (tokens.shape[0], num_tokens))
  state = {"cache": cache}

  def step():
    out, state["cache"] = _forward(model, chunk, state["cache"])
    return out

  return step


def read_step(num_bytes: int = _READ_BYTES) -> Callable[[], jax.Array]:
  """A callable that reads a `num_bytes` float32 array once (a jitted sum)."""
  data = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  return lambda: total(data)


def median_ms(steps: dict[str, Callable[[], Any]], repeats: int,
              warmup: int = 2) -> dict[str, float]:
  """Median ms per call of each step, timed round-robin.

  Interleaving the steps spreads load changes on a shared machine over all
  of them instead of biasing whichever ran during a busy spell.
  """
  for _ in range(warmup):
    for step in steps.values():
      jax.block_until_ready(step())
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step())
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def measure_cost(target: Any, draft: Any, prompts: Sequence[Sequence[int]],
                 cache_size: int, gammas: Sequence[int],
                 repeats: int) -> dict[str, Any]:
  """Forward times of both models on the same B rows, and c.

  Returns:
    `draft_forward_ms`, `target_forward_ms`, `draft_cost_ratio` (c), per γ
    `target_verify_ms` and `verify_cost_ratio` (verify / forward); for
    models that report `weight_bytes_per_token`, the read bandwidth and the
    target's roofline (`target_roofline_ms`, and `target_forward_efficiency`
    = roofline / measured).
  """
  steps = {"draft": forward_step(draft, prompts, cache_size, 1),
           "target": forward_step(target, prompts, cache_size, 1)}
  for g in gammas:
    steps[str(g)] = forward_step(target, prompts, cache_size, g + 1)
  weight_bytes = getattr(target, "weight_bytes_per_token", None)
  if weight_bytes:
    steps["read"] = read_step()
  ms = median_ms(steps, repeats)
  draft_ms, target_ms = ms.pop("draft"), ms.pop("target")
  roofline = {}
  if weight_bytes:
    bandwidth = _READ_BYTES / (ms.pop("read") / 1e3)  # bytes/s
    roofline_ms = 1e3 * weight_bytes / bandwidth
    roofline = {
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "target_weight_gb": weight_bytes / 1e9,
        "target_roofline_ms": roofline_ms,
        "target_forward_efficiency": roofline_ms / target_ms,
    }
  return {
      **roofline,
      "batch_size": len(prompts),
      "draft_forward_ms": draft_ms,
      "target_forward_ms": target_ms,
      "draft_cost_ratio": draft_ms / target_ms,
      "target_verify_ms": ms,
      "verify_cost_ratio": {g: v / target_ms for g, v in ms.items()},
      "repeats": repeats,
  }
