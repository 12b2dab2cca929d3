"""One acceptance estimator: decayed counts per row and draft position.

Shape letters (`specjax.shapes`): B batch, G = γ_max.

Per row and draft position, exponentially decayed counts of the steps that
verified the position and of those that accepted it (`AutoState`
`verified`, `accepted`), and the same undecayed (`seen_verified`,
`seen_accepted`). The estimate is their ratio; position 1 starts from a
prior (one decaying pseudo-observation) and a deeper position leans on the
estimate before it with the weight of one observation, so a position
rarely reached is neither forgotten nor guessed from a fixed prior. The
batch's pooled estimate and the evidence behind it give the mean and, with
a standard error, the confidence bound the policy hopes with.

`Estimates` is mixed into a policy dataclass that has the fields `rate`,
`start_verified`, `start_accepted`, `start_trials`, `start_rows` and
`max_gamma` (`specjax.policies.auto.Auto`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

__all__ = ["AutoState", "Estimates"]


@flax.struct.dataclass(kw_only=True)
class AutoState:
  """`Auto`'s state: the estimator's counts and the probe schedule.

  Attributes:
    verified: [B, G] float32 decayed count of steps in which each draft
      position was verified, per row.
    accepted: [B, G] float32 the same count of acceptances.
    seen_verified: [B, G] float32 the steps of this generation in which
      each draft position was verified, not decayed (`Auto.warm`; position
      1's are the evidence behind `Auto.hoped`'s confidence bound).
    seen_accepted: [B, G] float32 the same count of acceptances.
    idle: [] int32 consecutive steps without drafting.
    wait: [] int32 steps without drafting before the next probe.
  """

  verified: jax.Array
  accepted: jax.Array
  seen_verified: jax.Array
  seen_accepted: jax.Array
  idle: jax.Array
  wait: jax.Array


class Estimates:
  """Acceptance estimates from an `AutoState`'s counts."""

  def acceptance(self, state: AutoState) -> jax.Array:
    """[B, G] conditional acceptance estimates: position 1 accepted over
    verified; position j > 1 the same with the estimate of position j - 1
    added as one more observation."""
    return self._estimates(state.verified, state.accepted)

  def _estimates(self, verified: jax.Array, accepted: jax.Array
                 ) -> jax.Array:
    """[..., G] `acceptance` from decayed counts [..., G]."""
    first = accepted[..., 0] / jnp.maximum(verified[..., 0], 1e-6)
    columns = [first]
    for j in range(1, self.max_gamma):
      columns.append((accepted[..., j] + columns[-1])
                     / (verified[..., j] + 1.0))
    return jnp.stack(columns, axis=-1)

  def pooled(self, state: AutoState, active: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """The batch's estimates, [G], from its rows' counts summed, and the
    verifications behind them, [G] (`evidence`; position 1's: the steps
    that verified it in some row).

    The rows are the active ones and those that have ended after
    verifying something: the rows still running near the end are those
    whose drafts were rejected more, so a pool of them alone would be
    biased low exactly when the finish time is chosen by it.

    Each row holds a decayed copy of its start counts (the prior, or what
    `warm` carried); summed, they would count B times and outweigh the
    batch's first observations. So the start counts are counted once, at
    the rows' mean decay ((1 - rate)^n for a row that verified position 1
    n times; deeper positions decay no faster), times the rows they stand
    for (`start_rows`: 1 for the prior, an earlier batch's B after
    `warm`).
    """
    seen = state.seen_verified[:, 0]  # [B] position 1's verifications
    active = active | (seen > 0)
    decay = jnp.where(active, (1.0 - self.rate) ** seen, 0.0)  # [B]
    rows = jnp.sum(active)
    # The start counts' weight in the pool: the rows' mean decay, times the
    # rows they stand for.
    weight = jnp.sum(decay) / jnp.maximum(rows, 1) * self.start_rows

    def pool(counts, start):  # [B, G], [G] -> [G]
      own = jnp.maximum(counts - start[None] * decay[:, None], 0.0)
      return (jnp.sum(jnp.where(active[:, None], own, 0.0), 0)
              + start * weight)

    estimates = self._estimates(pool(state.verified, self.start_verified),
                                pool(state.accepted, self.start_accepted))
    return jnp.clip(estimates, 0.0, 1.0), self.evidence(state, active)

  def evidence(self, state: AutoState, active: jax.Array) -> jax.Array:
    """[G] the verifications behind each position's pooled estimate, not
    decayed: those of the batch's rows (active, or ended after verifying
    something, as in `pooled`) and the start counts', for each of the
    `start_rows` rows they stand for: `start_trials` for position 1 (the
    steps behind it, `hoped`'s n), `start_verified` past it."""
    seen = state.seen_verified  # [B, G]
    counts = active | (seen[:, 0] > 0)
    start = self.start_verified.at[0].set(self.start_trials)
    return (jnp.sum(jnp.where(counts[:, None], seen, 0.0), 0)
            + start * self.start_rows * jnp.any(counts))

  def _learn(self, state: AutoState, judged: jax.Array,
             accepted: jax.Array) -> AutoState:
    """`state` with the decayed counts of the positions `judged` [B, G]
    (bool) each verified once and accepted by `accepted` ([B, G] or
    broadcastable, float32), the same in the undecayed counts of the
    generation (`seen_verified`, `seen_accepted`)."""
    keep = 1.0 - self.rate
    decay = lambda count, new: jnp.where(judged, keep * count + new, count)
    accepted = jnp.where(judged, accepted, 0.0)
    return state.replace(verified=decay(state.verified, 1.0),
                         accepted=decay(state.accepted, accepted),
                         seen_verified=state.seen_verified + judged,
                         seen_accepted=state.seen_accepted + accepted)
