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
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specjax import decode
from specjax.hardware import median_ms

__all__ = ["compiled_forward_hlo", "forward_step", "measure_cost",
           "median_ms", "read_step"]

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


def compiled_forward_hlo(model: Any, tokens: jax.Array, cache: Any) -> str:
  """The optimised HLO text of the forward `forward_step` runs."""
  return _forward.lower(model, tokens, cache).compile().as_text()


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


def measure_cost(target: Any, draft: Any, prompts: Sequence[Sequence[int]],
                 cache_size: int, gammas: Sequence[int],
                 repeats: int) -> dict[str, Any]:
  """Forward times of both models on the same B rows, and c.

  Returns:
    For each of `draft` and `target`: `{m}_forward_ms`, per γ
    `{m}_verify_ms` (γ+1 tokens) and `{m}_verify_ratio` (verify / forward);
    `draft_cost_ratio` (c) and `verify_cost_ratio` (the target's); for
    models that report `weight_bytes_per_token`, the read bandwidth and
    each model's roofline (`{m}_weight_gb`, `{m}_roofline_ms`, and
    `{m}_forward_efficiency` = roofline / measured forward).
  """
  models = {"draft": draft, "target": target}
  steps = {}
  for name, model in models.items():
    steps[(name, 1)] = forward_step(model, prompts, cache_size, 1)
    for g in gammas:
      steps[(name, g + 1)] = forward_step(model, prompts, cache_size, g + 1)
  weight_bytes = {name: getattr(model, "weight_bytes_per_token", None)
                  for name, model in models.items()}
  if weight_bytes["target"]:
    steps["read"] = read_step()
  ms = median_ms(steps, repeats)
  out = {"batch_size": len(prompts), "repeats": repeats}
  for name in models:
    forward = ms[(name, 1)]
    verify = {str(g): ms[(name, g + 1)] for g in gammas}
    out[f"{name}_forward_ms"] = forward
    out[f"{name}_verify_ms"] = verify
    out[f"{name}_verify_ratio"] = {g: v / forward for g, v in verify.items()}
  out["draft_cost_ratio"] = out["draft_forward_ms"] / out["target_forward_ms"]
  out["verify_cost_ratio"] = out["target_verify_ratio"]  # the one c needs
  if "read" in ms:
    bandwidth = _READ_BYTES / (ms["read"] / 1e3)  # bytes/s
    out["read_bandwidth_gb_s"] = bandwidth / 1e9
    for name in models:
      if weight_bytes[name]:
        roofline_ms = 1e3 * weight_bytes[name] / bandwidth
        out[f"{name}_weight_gb"] = weight_bytes[name] / 1e9
        out[f"{name}_roofline_ms"] = roofline_ms
        out[f"{name}_forward_efficiency"] = (roofline_ms
                                            / out[f"{name}_forward_ms"])
  return out
