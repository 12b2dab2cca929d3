"""A γ policy's throughput under the cost model, free of timing noise.

Shape letters (`specjax.shapes`): B batch, G = γ_max, W verification
widths, N simulated generations.

On a shared CPU the spread between rounds of one program can exceed the
gap between two policies, so a measured sweep cannot tell whether a policy
chooses well. `simulate` runs the policy's own `budget`, `trim` and
`update` (the functions `speculate_step` calls) on synthetic acceptance:
each draft position is accepted with probability α, independently, as in
`speculative_generate(..., synthetic_acceptance=α)`, and as there the
verdicts are a synthetic text (`rejection.Synthetic`): the draft of a
row's n-th token is accepted iff that token's draw is under α, whichever
step judges it, so the policies simulated with one seed decode the same
texts and differ by their choices alone. It prices every step
with the costs the cost model measured, as `speculate_step` would run it:
the target pass at the smallest compiled width holding the longest
verified proposal, and, when a row drafts, the draft model's first
(catch-up) pass, one forward per further draft token, and the catch-up on
the tokens emitted while it was idle (priced as `Auto.probe_ms` prices
it). What it reports is therefore the policy's own loss against the best
fixed choice in hindsight, with the cost model taken as exact; the cost
model's error is measured apart (`scripts/bench_crossover.py`).

A fixed γ is the policy that budgets γ every step; autoregressive decoding
is γ = 0. For them `simulate` reproduces `cost.predict_tokens_per_s`
with the same `tokens`, the batch's slowest row included
(`tests/test_simulate.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import policies
from specjax.step_types import Proposal

__all__ = ["Fixed", "SimCosts", "auto_policy", "over_best", "policy_costs",
           "settled", "simulate"]


@flax.struct.dataclass
class Fixed(policies.GammaPolicy):
  """Budgets `gamma` drafts for every active row at every step (0:
  autoregressive decoding)."""

  gamma: int = flax.struct.field(pytree_node=False)
  max_gamma: int = flax.struct.field(pytree_node=False)

  def __post_init__(self):
    # A budget past G would index past the compiled widths, which JAX
    # clamps silently: the step would be priced at the widest pass.
    policies.verify_widths(self.max_gamma)  # validates G
    if not 0 <= self.gamma <= self.max_gamma:
      raise ValueError(f"gamma must be in [0, max_gamma={self.max_gamma}],"
                       f" got {self.gamma}.")

  def init(self, batch):
    return policies.Heuristic(self.max_gamma).init(batch)

  def budget(self, state, active, remaining=None):
    del state, remaining
    return jnp.where(active, self.gamma, 0).astype(jnp.int32)

  def update(self, state, budget, proposal, num_accepted, active):
    del budget, proposal, num_accepted, active
    return state


@dataclasses.dataclass(frozen=True)
class SimCosts:
  """What one step costs, in ms.

  Attributes:
    target_ms: [W] a target pass of each width in `verify_widths(G)`.
    draft_ms: a draft forward of one token (0: a drafter without a model).
    first_draft_ms: a step's first draft token (the two-token catch-up
      pass).
  """

  target_ms: Sequence[float]
  draft_ms: float = 0.0
  first_draft_ms: float = 0.0


@flax.struct.dataclass(kw_only=True)
class _State:
  """Simulated generations.

  Attributes:
    policy: the policy's state, batch B.
    generated: [B] int32 tokens emitted per row.
    lag: [] int32 tokens the draft model has not seen (emitted by plain
      steps since it last drafted).
    ms: [] float32 time spent.
    text: [B, N + G + 1] float32 uniforms: a draft of row b's output
      token n is accepted iff text[b, n] < α, whichever step judges it
      (`rejection.Synthetic`), so that the policies simulated with one
      key decode the same text.
  """

  policy: policies.PolicyState
  generated: jax.Array
  lag: jax.Array
  ms: jax.Array
  text: jax.Array


def _step(policy: policies.GammaPolicy, costs: SimCosts, alpha: jax.Array,
          tokens: int, state: _State) -> _State:
  """One speculative step of every row, as `speculate_step` takes it."""
  max_gamma = alpha.shape[0]
  target_ms = jnp.asarray(costs.target_ms, jnp.float32)
  active = state.generated < tokens  # [B]
  remaining = tokens - state.generated  # [B]
  budget = policy.budget(state.policy, active, remaining)  # [B]
  drafting = jnp.any(budget > 0)
  drafted = jnp.minimum(budget, policy.trim(state.policy, budget, active,
                                            remaining))  # [B]
  width = policies.width_index(policy.widths, jnp.max(drafted) + 1)
  draft_ms = (policies.drafting_ms(jnp.max(budget), costs.first_draft_ms,
                                   costs.draft_ms)
              + policies.catch_up_ms(state.lag, costs.draft_ms, target_ms,
                                     max_gamma))
  positions = 1 + state.generated[:, None] + jnp.arange(max_gamma)[None]
  accept = jnp.take_along_axis(state.text, positions, axis=1) < alpha
  # The first rejected position, at most the drafts verified.
  num_accepted = jnp.minimum(
      jnp.sum(jnp.cumprod(accept, axis=1), axis=1), drafted)  # [B]
  num_accepted = jnp.where(active, num_accepted, 0)
  emitted = jnp.where(active, jnp.minimum(num_accepted + 1, remaining), 0)
  proposal = Proposal(tokens=jnp.zeros((budget.shape[0], max_gamma),
                                       jnp.int32),
                      num_drafted=drafted, num_forwards=jnp.int32(0))
  return state.replace(
      policy=policy.update(state.policy, budget, proposal, num_accepted,
                           active),
      generated=state.generated + emitted,
      lag=jnp.where(drafting, 0, state.lag + 1),
      ms=state.ms + target_ms[width] + jnp.where(drafting, draft_ms, 0.0))


def _generation(policy: policies.GammaPolicy, costs: SimCosts,
                alpha: jax.Array, batch: int, tokens: int,
                observe_first: bool, key: jax.Array) -> _State:
  """One simulated generation of `batch` rows, from `policy.init`."""
  # Column 0: the first token, emitted at prefill, whose draft guess
  # `observe` judges; column 1 + n: the n-th token emitted after it.
  text = jax.random.uniform(key, (batch, tokens + alpha.shape[0] + 1))
  start = policy.init(batch)
  if observe_first:
    start = policy.observe(start, (text[:, 0] < alpha[0]).astype(
        jnp.float32), jnp.ones((batch,), bool))
  state = _State(policy=start, generated=jnp.zeros((batch,), jnp.int32),
                 lag=jnp.int32(0), ms=jnp.float32(0.0), text=text)
  return jax.lax.while_loop(
      lambda s: jnp.any(s.generated < tokens),
      functools.partial(_step, policy, costs, alpha, tokens), state)


@functools.partial(jax.jit, static_argnames=("costs", "batch", "tokens",
                                             "samples", "observe_first",
                                             "warm_after"))
def _simulate(policy, costs, alpha, batch, tokens, samples, key,
              observe_first, warm_after):
  run = functools.partial(_generation, costs=costs, alpha=alpha,
                          batch=batch, tokens=tokens,
                          observe_first=observe_first)

  def sample(key):  # [] ms of the last of warm_after + 1 generations
    current = policy
    for _ in range(warm_after):
      key, earlier = jax.random.split(key)
      current = current.warm(run(current, key=earlier).policy)
    return run(current, key=key).ms

  return jax.vmap(sample)(jax.random.split(key, samples))  # [N]


def _per_position(alpha: float | Sequence[float], max_gamma: int
                  ) -> np.ndarray:
  """[G] float32 acceptance per draft position from one probability or G
  of them; a ValueError names any other."""
  alpha = np.asarray(alpha, np.float32)
  if alpha.shape not in ((), (max_gamma,)) or not np.all(
      (alpha >= 0) & (alpha <= 1)):
    raise ValueError(f"alpha must be one probability or {max_gamma} (one "
                     f"per draft position), got {alpha.tolist()}.")
  return np.broadcast_to(alpha, (max_gamma,))


def simulate(policy: policies.GammaPolicy, costs: SimCosts, *,
             alpha: float | Sequence[float], batch: int, tokens: int,
             samples: int = 256, seed: int = 0,
             observe_first: bool | None = None,
             warm_after: int = 0) -> float:
  """Mean predicted tokens/s of `policy` over `samples` generations.

  Args:
    policy: a `GammaPolicy` (`Fixed(γ, G)` for a fixed γ).
    costs: the step costs at this batch size (`SimCosts`).
    alpha: the probability that a draft position is accepted given that
      every earlier one was: one value for all positions, or G values.
    batch: B rows, each generating `tokens` tokens (no EOS).
    tokens: tokens per row.
    samples: N generations simulated.
    seed: the seed of the simulated texts.
    observe_first: the policy observes position 1 once per row before the
      first step (`GammaPolicy.observe`), as `speculative_generate` lets it
      from a draft model's prefill; None: where the costs have a draft
      model (`draft_ms` > 0).

  Returns:
    B · tokens / (mean time of a generation), in tokens per second.
  """
  max_gamma = policy.max_gamma
  alpha = _per_position(alpha, max_gamma)  # [G]
  if batch < 1 or tokens < 1 or samples < 1 or warm_after < 0:
    raise ValueError(f"batch, tokens and samples must be >= 1 and "
                     f"warm_after >= 0, got {batch}, {tokens}, {samples} "
                     f"and {warm_after}.")
  alpha = jnp.asarray(alpha)
  if len(costs.target_ms) != len(policy.widths):
    raise ValueError(f"costs.target_ms needs one time per width "
                     f"{policy.widths}, got {len(costs.target_ms)}.")
  costs = dataclasses.replace(costs,
                              target_ms=tuple(map(float, costs.target_ms)))
  if observe_first is None:
    observe_first = costs.draft_ms > 0
  ms = _simulate(policy, costs, alpha, batch, tokens, samples,
                 jax.random.PRNGKey(seed), bool(observe_first),
                 int(warm_after))
  return batch * tokens / (float(jnp.mean(ms)) / 1e3)


def auto_policy(costs: SimCosts, max_gamma: int,
                **kwargs) -> policies.Auto:
  """`policies.Auto.create` with these costs (the inverse of
  `policy_costs`); `kwargs` are its other arguments."""
  return policies.Auto.create(
      max_gamma=max_gamma, target_ms=costs.target_ms,
      draft_ms=costs.draft_ms, first_draft_ms=costs.first_draft_ms,
      **kwargs)


def settled(policy: policies.Auto, alpha: float | Sequence[float],
            trials: float = 32.0) -> policies.Auto:
  """`policy` as `Auto.warm` starts it after a long generation at
  acceptance `alpha` (one value, or G, one per draft position): every
  position at its steady decayed count, 1 / rate observations, its α of
  them accepted, and `trials` steps behind position 1 (a warm start in
  simulation, knowing α)."""
  count = jnp.full((policy.max_gamma,), 1.0 / policy.rate, jnp.float32)
  accepted = jnp.asarray(_per_position(alpha, policy.max_gamma)) * count
  return policy.replace(start_verified=count, start_accepted=accepted,
                        start_trials=jnp.float32(trials),
                        first_wait=policy.probe_every)


def policy_costs(policy: Any) -> SimCosts:
  """The `SimCosts` an `Auto` policy was created with."""
  return SimCosts(target_ms=tuple(map(float, policy.target_ms)),
                  draft_ms=float(policy.draft_ms),
                  first_draft_ms=float(policy.first_draft_ms))


def over_best(policy: policies.GammaPolicy, costs: SimCosts, *,
              alpha: float | Sequence[float], batch: int, tokens: int,
              gammas: Sequence[int] | None = None, samples: int = 256,
              seed: int = 0, observe_first: bool | None = None,
              warm_after: int = 0) -> float:
  """`policy`'s simulated tokens/s over the best fixed γ in hindsight.

  Args:
    policy: a `GammaPolicy`.
    costs, alpha, batch, tokens, samples, seed, observe_first: as in
      `simulate`.
    warm_after: as in `simulate`, for `policy` only (a fixed γ learns
      nothing).
    gammas: the fixed γ to compare with (0: autoregressive decoding);
      default 0 to G.

  Returns:
    simulate(policy) / max over γ of simulate(Fixed(γ, G)).
  """
  gammas = range(policy.max_gamma + 1) if gammas is None else gammas
  rate = lambda p, **kw: simulate(p, costs, alpha=alpha, batch=batch,
                                  tokens=tokens, samples=samples, seed=seed,
                                  observe_first=observe_first, **kw)
  return rate(policy, warm_after=warm_after) / max(
      rate(Fixed(g, policy.max_gamma)) for g in gammas)
