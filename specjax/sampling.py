"""Sampling parameters and logits -> processed probabilities.

Shape letters (`specjax.shapes`): V vocab; `...` any leading batch/position
axes.

Temperature, top-k and top-p are traced scalars, so changing them never
recompiles; the branches (greedy, plain softmax, sorted filtering) are chosen
with `lax.cond` at run time. Greedy (temperature 0) is a one-hot distribution
at the argmax, so the rejection sampler treats it like any other distribution.
The same processing is applied to draft and target logits, which is what makes
speculative sampling reproduce the target's *processed* distribution.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass(kw_only=True)
class SamplingParams:
  """Traced sampling settings, shared by every row of a batch.

  Attributes:
    temperature: [] float32; 0 means greedy.
    top_k: [] int32; keep the k most likely tokens, 0 disables.
    top_p: [] float32 in (0, 1]; keep the smallest set with this much mass.
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  @classmethod
  def create(cls, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0) -> "SamplingParams":
    """Validates host values and wraps them as arrays."""
    temperature, top_p = float(temperature), float(top_p)
    if not temperature >= 0.0:  # also rejects NaN
      raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if int(top_k) != top_k or top_k < 0:
      raise ValueError(f"top_k must be a non-negative integer, got {top_k}.")
    return cls(temperature=jnp.float32(temperature),
               top_k=jnp.int32(top_k), top_p=jnp.float32(top_p))

  @property
  def greedy(self) -> jax.Array:
    return self.temperature == 0.0


def greedy_probs(logits: jax.Array) -> jax.Array:
  """[..., V] -> one-hot [..., V] float32 at the argmax (first on ties)."""
  return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1],
                        dtype=jnp.float32)


def _filtered_logits(scaled: jax.Array, top_k: jax.Array,
                     top_p: jax.Array) -> jax.Array:
  """Masks to -inf what top-k then top-p remove. [..., V] -> [..., V].

  Ties at a threshold are kept (as Hugging Face's warpers do).
  """
  vocab = scaled.shape[-1]
  desc = -jnp.sort(-scaled, axis=-1)  # [..., V] descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  ranks = jnp.arange(vocab)
  desc = jnp.where(ranks < k, desc, -jnp.inf)
  # Top-p on what top-k kept: keep a token while the mass before it < top_p.
  sorted_probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  keep = (mass_before < top_p) & (ranks < k)
  num_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
  threshold = jnp.take_along_axis(desc, num_keep - 1, axis=-1)  # [..., 1]
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Processed next-token distribution.

  Args:
    logits: [..., V] float.
    params: sampling settings.

  Returns:
    [..., V] float32 probabilities: one-hot argmax when greedy, otherwise
    softmax(logits / temperature) restricted to top-k, then top-p.
  """
  logits = logits.astype(jnp.float32)

  def sampled(logits):
    scaled = logits / params.temperature
    filtering = (params.top_k > 0) | (params.top_p < 1.0)
    scaled = jax.lax.cond(
        filtering, lambda s: _filtered_logits(s, params.top_k, params.top_p),
        lambda s: s, scaled)
    return jax.nn.softmax(scaled, axis=-1)

  return jax.lax.cond(params.greedy, greedy_probs, sampled, logits)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one token per distribution by inverting its CDF.

  One uniform per row instead of Gumbel noise over the whole vocabulary (3x
  faster at V = 152k on CPU). Zero-probability tokens have empty CDF
  intervals and are never drawn, so one-hot (greedy) distributions return
  their hot index exactly.

  Args:
    key: PRNG key.
    probs: [..., V] probabilities (need not be normalised).

  Returns:
    [...] int32 token ids.
  """
  cdf = jnp.cumsum(probs.astype(jnp.float32), axis=-1)  # [..., V]
  u = jax.random.uniform(key, probs.shape[:-1] + (1,)) * cdf[..., -1:]
  above = cdf > u
  # Rounding can leave u at the total mass: fall back to the argmax.
  token = jnp.where(jnp.any(above, axis=-1), jnp.argmax(above, axis=-1),
                    jnp.argmax(probs, axis=-1))
  return token.astype(jnp.int32)
