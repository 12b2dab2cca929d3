"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Shape letters (`specjax.shapes`): B batch, G = γ draft tokens per step, V
vocab.

Draft token i (in order) is accepted with probability min(1, p_i(x_i) /
q_i(x_i)). At the first rejection the next token is drawn from the residual
norm(max(0, p_i - q_i)); when every proposed token is accepted it is drawn from
p at the next position (the bonus token). The emitted tokens are then
distributed exactly as the target's p. With one-hot p and q this is greedy
verification; no separate code path exists.

Positions a drafter did not propose (`num_drafted[b] <= i`) are treated as a
proposal with q = 0 that is always rejected, so the residual there is p
itself.

A deterministic drafter (prompt lookup) may omit q (`q=None`): q is then
one-hot at each proposed token, so token x is accepted with probability
p(x), and on a rejection the next token is drawn from p with x removed and
renormalised. Nothing of shape [B, G, V] is built for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import sampling

# Residual mass below this is treated as zero (p == q up to rounding); the
# target distribution itself is sampled instead.
_RESIDUAL_EPS = 1e-9


def gather(probs: jax.Array, tokens: jax.Array) -> jax.Array:
  """probs [B, G, V], tokens [B, G] -> [B, G]."""
  return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def at_position(probs: jax.Array, index: jax.Array) -> jax.Array:
  """probs [B, G', V] at per-row position index [B] -> [B, V]."""
  return jnp.take_along_axis(probs, index[:, None, None], axis=1)[:, 0]


def proposed_mask(num_drafted: jax.Array | None, batch: int,
                  gamma: int) -> jax.Array:
  """[B, G] bool: which positions were proposed."""
  if num_drafted is None:
    return jnp.ones((batch, gamma), bool)
  return jnp.arange(gamma)[None] < num_drafted[:, None]


def leading_true(accept: jax.Array) -> jax.Array:
  """[B, G] bool -> [B] int32, the length of the all-true prefix."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)


def q_at(q: jax.Array | None, draft_tokens: jax.Array, proposed: jax.Array,
         index: jax.Array, vocab: int) -> jax.Array:
  """The draft distribution at per-row position `index` [B] -> [B, V].

  Zero where `index` is G or the position was not proposed; one-hot at the
  drafted token when `q` is None.
  """
  batch, gamma = draft_tokens.shape
  clipped = jnp.minimum(index, gamma - 1)
  live = (index < gamma) & jnp.take_along_axis(proposed, clipped[:, None],
                                                axis=1)[:, 0]  # [B]
  if q is None:
    token = jnp.take_along_axis(draft_tokens, clipped[:, None], axis=1)
    q_n = jax.nn.one_hot(token[:, 0], vocab, dtype=jnp.float32)
  else:
    q_n = at_position(q, clipped)
  return jnp.where(live[:, None], q_n, 0.0)


def next_token(key: jax.Array, num_accepted: jax.Array, q: jax.Array | None,
               p: jax.Array, draft_tokens: jax.Array,
               proposed: jax.Array, scale: jax.Array | float = 1.0
               ) -> jax.Array:
  """Samples the token after the accepted prefix.

  Args:
    key: PRNG key.
    num_accepted: [B] accepted count n.
    q: [B, G, V] draft probabilities, or None for one-hot at the drafts.
    p: [B, G+1, V] target probabilities.
    draft_tokens: [B, G] int32.
    proposed: [B, G] bool.
    scale: λ, q's weight in the residual (1: exact; `acceptance.Relaxed`).

  Returns:
    [B] int32 drawn from norm(max(0, p_n - λ q_n)), with q_n = 0 when n =
    G or position n was not proposed.
  """
  p_n = at_position(p, num_accepted)  # [B, V]
  q_n = scale * q_at(q, draft_tokens, proposed, num_accepted, p.shape[-1])
  residual = jnp.maximum(p_n - q_n, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  dist = jnp.where(mass > _RESIDUAL_EPS, residual / jnp.maximum(mass, 1e-30),
                   p_n)
  return sampling.sample(key, dist)


def no_drafts(key: jax.Array, p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """G = 0 (an autoregressive step): nothing accepted, the next token drawn
  from p [B, 1, V]."""
  _, next_key = jax.random.split(key)
  return (jnp.zeros(p.shape[:1], jnp.int32),
          sampling.sample(next_key, p[:, 0]))


def acceptance_probability(p: jax.Array, q: jax.Array) -> jax.Array:
  """[...] Σ_x min(p(x), q(x)) of p, q [..., V]: the probability that a
  token drawn from q is accepted against p (1 - total variation; under
  greedy decoding, where both are one-hot, whether their argmaxes agree)."""
  return jnp.sum(jnp.minimum(p, q), axis=-1)


def rejection_sample(
    key: jax.Array,
    draft_tokens: jax.Array,
    q: jax.Array | None,
    p: jax.Array,
    num_drafted: jax.Array | None = None,
    scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Verifies a block of draft tokens against the target.

  Args:
    key: PRNG key.
    draft_tokens: [B, G] int32 (G may be 0: a plain autoregressive step).
    q: [B, G, V] draft probabilities the tokens were drawn from, or None
      when the drafter is deterministic (one-hot at each drafted token).
    p: [B, G+1, V] target probabilities at the G draft positions and the one
      after them.
    num_drafted: optional [B] int32 <= G, how many leading positions were
      proposed (a drafter may stop early); default all G.
    scale: [] λ, or None for 1 (exact): accept against λq, draw the next
      token from norm(max(0, p - λq)) (`acceptance.Relaxed`).

  Returns:
    num_accepted [B] int32 in [0, G] and next_token [B] int32.
  """
  batch, gamma = draft_tokens.shape
  if gamma == 0:
    return no_drafts(key, p)
  accept_key, next_key = jax.random.split(key)
  p_x = gather(p[:, :gamma], draft_tokens)  # [B, G]
  q_x = 1.0 if q is None else gather(q, draft_tokens)  # [B, G]
  u = jax.random.uniform(accept_key, (batch, gamma))
  if scale is not None:
    u = u * scale
  proposed = proposed_mask(num_drafted, batch, gamma)
  # u < p/q without dividing: q = 0 accepts iff p > 0 (ratio +inf).
  num_accepted = leading_true((u * q_x < p_x) & proposed)
  return num_accepted, next_token(next_key, num_accepted, q, p,
                                  draft_tokens, proposed,
                                  1.0 if scale is None else scale)
