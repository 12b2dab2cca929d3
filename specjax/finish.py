"""When a batch ends: the expected steps until its slowest row is done.

Shape letters (`specjax.shapes`): B batch, G = γ_max.

A generation of B rows runs until its last row has emitted its tokens, so
a draft budget K that emits the most tokens per ms on average can still end
the batch later than a smaller one: the spread of the rows' step counts
grows with K, and the batch waits for the slowest. `expected_steps` prices
that, inside the compiled loop, for every K at once: the exact
E[max over rows of a row's steps] when each step emits τ tokens per row,
P(τ > i) = Π_{j≤i} a_j for i ≤ K, independently, and a row with r tokens
left is done once it has emitted r (its last step's extra tokens are cut).
`tuning.cost.expected_steps` is the same quantity on the host for rows
drawn alike; the two agree (`tests/test_finish.py`).

With F_b(s) the probability that row b is done after s steps,
E[max] = Σ_{s≥0} (1 - Π_b F_b(s)). F_b(s) comes from the distribution of
what a row has emitted after s steps, carried step by step as
P(emitted ≥ n) for n = 0..horizon, one (K+1)-tap convolution a step: cost
O(B · (G+1)² · horizon) a step, for at most `horizon` steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["emit_probabilities", "expected_steps"]


def emit_probabilities(acceptance: jax.Array) -> jax.Array:
  """[B, G+1, G+1] P(τ = i + 1) for a budget of K drafts (axis 1, K = 0..G;
  axis 2, i = 0..G) from [B, G] conditional acceptances a_j: P(τ > i) =
  Π_{j≤i} a_j for i ≤ K, 0 beyond."""
  batch, max_gamma = acceptance.shape
  survive = jnp.concatenate([jnp.ones((batch, 1), acceptance.dtype),
                             jnp.cumprod(acceptance, axis=1)], 1)  # [B, G+1]
  i = jnp.arange(max_gamma + 1)
  survive = jnp.where(i[None, None, :] <= i[None, :, None],
                      survive[:, None, :], 0.0)  # [B, G+1 (K), G+1 (i)]
  return survive - jnp.concatenate(
      [survive[..., 1:], jnp.zeros_like(survive[..., :1])], -1)


def expected_steps(emit: jax.Array, remaining: jax.Array, active: jax.Array,
                   horizon: int) -> jax.Array:
  """[G+1] E[steps until every active row is done], for each budget K.

  Args:
    emit: [B, G+1, G+1] P(τ = i + 1) per row and budget K
      (`emit_probabilities`), or [1, G+1, G+1] for rows alike: the
      distribution is then carried once and only the rows' ends differ.
    remaining: [B] int32 tokens each row has left; at most `horizon` for
      an active row (rows beyond it are counted as done at `horizon`).
    active: [B] bool rows that count (the rest are done).
    horizon: static, the most tokens a row may have left.

  Returns:
    [G+1] float32 expected steps of the batch under a constant budget K.
  """
  batch, budgets, taps = emit.shape
  left = jnp.clip(jnp.where(active, remaining, 0), 0, horizon)  # [B]
  pick = jax.nn.one_hot(left, horizon + 1, dtype=emit.dtype)[:, None]
  # [B, G+1, horizon+1] P(emitted >= n) after s steps; n <= 0 is certain.
  reached = jnp.zeros((batch, budgets, horizon + 1), emit.dtype)
  reached = reached.at[..., 0].set(1.0)
  certain = jnp.ones((batch, budgets, taps), emit.dtype)

  def step(_, carry):
    reached, total = carry
    done = jnp.sum(reached * pick, -1)  # [B, G+1] F_b(s)
    total = total + 1.0 - jnp.prod(done, 0)
    padded = jnp.concatenate([certain, reached], -1)
    # P(emitted >= n after s+1) = Σ_i P(τ = i+1) P(emitted >= n-i-1 after s)
    reached = sum(emit[..., i, None]
                  * padded[..., taps - 1 - i:taps - i + horizon]
                  for i in range(taps))
    return reached, total

  # Every step emits at least one token, so the slowest row is done after
  # max(left) steps.
  _, total = jax.lax.fori_loop(0, jnp.max(left), step,
                               (reached, jnp.zeros((budgets,), emit.dtype)))
  return total
