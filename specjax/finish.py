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
E[max] = Σ_{s≥0} (1 - Π_b F_b(s)), from the distribution of the tokens a
row has emitted after s steps, in one of two ways (`serial`):

- step by step: P(emitted ≥ n) for n = 0..horizon carried through a loop
  of max(tokens left) iterations, one (G+1)-tap convolution each,
  O(B · (G+1)² · horizon) an iteration;
- all steps at once: the s-th power of the generating function of τ,
  truncated at the `horizon` tokens that matter, every power s < `horizon`
  by doubling (the powers 0..2^j - 1 times the 2^j-th give 2^j..2^{j+1} -
  1): log2(horizon) products of a [.., 2^j, horizon] table by a
  [horizon, horizon] Toeplitz matrix, with no loop.

On the CPU an operation costs about a microsecond, so the loop's ~16
small operations an iteration beat the dense products; on a GPU each
operation is a kernel launch and each iteration reads the loop's
condition back to the host, so the doubling's ~40 launches in all win.
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


def _times(table: jax.Array, factor: jax.Array) -> jax.Array:
  """[..., M, N] each row's polynomial (coefficients of z^0..z^{N-1}) times
  `factor` [..., N], truncated at z^{N-1}: (a·b)_n = Σ_{m≤n} a_m b_{n-m}."""
  n = factor.shape[-1]
  shift = jnp.arange(n)[None, :] - jnp.arange(n)[:, None]  # [N (m), N (n)]
  toeplitz = jnp.where(shift >= 0, jnp.take(factor, jnp.maximum(shift, 0),
                                            axis=-1), 0.0)  # [..., N, N]
  # Probabilities, not activations: full float32 where the default would be
  # TF32 or bf16 passes (GPU, TPU).
  return jnp.matmul(table, toeplitz, precision=jax.lax.Precision.HIGHEST)


def _powers(step: jax.Array, count: int) -> jax.Array:
  """[..., count, N] the powers 0..count-1 of the polynomial `step`
  [..., N], each truncated at z^{N-1}, by doubling."""
  one = jnp.zeros_like(step).at[..., 0].set(1.0)
  table, power = one[..., None, :], step  # [..., 1, N], [..., N]
  while table.shape[-2] < count:
    table = jnp.concatenate([table, _times(table, power)], -2)
    if table.shape[-2] < count:
      power = _times(power[..., None, :], power)[..., 0, :]
  return table[..., :count, :]


def _serial(emit: jax.Array, left: jax.Array, horizon: int) -> jax.Array:
  """[G+1] E[max steps], the distribution carried step by step."""
  batch, budgets, taps = emit.shape
  pick = jax.nn.one_hot(left, horizon + 1, dtype=emit.dtype)[:, None]
  # [B', G+1, horizon+1] P(emitted >= n) after s steps; n <= 0 is certain.
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


def _at_once(emit: jax.Array, left: jax.Array, horizon: int) -> jax.Array:
  """[G+1] E[max steps], every step's distribution by doubling."""
  taps = emit.shape[-1]
  # [B', G+1, horizon] P(τ = n) for n = 0..horizon-1: τ = i + 1 is z^{i+1}.
  step = jnp.concatenate(
      [jnp.zeros_like(emit[..., :1]), emit,
       jnp.zeros(emit.shape[:-1] + (max(horizon - taps - 1, 0),),
                 emit.dtype)], -1)[..., :horizon]
  # The slowest row is done after `horizon` steps: s < horizon are all the
  # terms that are not 0.
  emitted = _powers(step, horizon)  # [B', G+1, s, n] P(emitted = n)
  # F_b(s) = 1 - P(emitted < left_b); a row with 0 left is done.
  short = (jnp.arange(horizon) < left[:, None]).astype(emit.dtype)  # [B, n]
  if emit.shape[0] == 1:
    undone = jnp.einsum("ksn,bn->bks", emitted[0], short)
  else:
    undone = jnp.einsum("bksn,bn->bks", emitted, short)
  done = jnp.clip(1.0 - undone, 0.0, 1.0)  # [B, G+1, s]
  return jnp.sum(1.0 - jnp.prod(done, 0), -1)


def expected_steps(emit: jax.Array, remaining: jax.Array, active: jax.Array,
                   horizon: int, serial: bool | None = None) -> jax.Array:
  """[G+1] E[steps until every active row is done], for each budget K.

  Args:
    emit: [B, G+1, G+1] P(τ = i + 1) per row and budget K
      (`emit_probabilities`), or [1, G+1, G+1] for rows alike: the
      distribution is then computed once and only the rows' ends differ.
    remaining: [B] int32 tokens each row has left; at most `horizon` for
      an active row (rows beyond it are counted as done at `horizon`).
    active: [B] bool rows that count (the rest are done).
    horizon: static, the most tokens a row may have left.
    serial: static: carry the distribution step by step in a loop (True)
      or compute every step's at once (False); None: serially on the CPU
      backend only (module docstring).

  Returns:
    [G+1] float32 expected steps of the batch under a constant budget K.
  """
  if serial is None:
    serial = jax.default_backend() == "cpu"
  left = jnp.clip(jnp.where(active, remaining, 0), 0, horizon)  # [B]
  if not horizon:
    return jnp.zeros(emit.shape[1:2], emit.dtype)
  return (_serial if serial else _at_once)(emit, left, horizon)
