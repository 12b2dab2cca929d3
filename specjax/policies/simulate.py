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
texts and differ by their choices alone.

Every step is priced by one `policies.StepCosts`, the costs a call's
policy chooses by: the target pass at the smallest width of
`verify_widths(G)` holding the longest verified proposal, and, when a row
drafts, the drafter's `drafting_ms` and its catch-up on the tokens plain
steps emitted while it was idle (`catch_up_ms`). What it reports is the
policy's own loss against the best fixed choice in hindsight, with the
cost model taken as exact (or, with `truth`, priced by other costs than
the policy's).

A fixed γ is `policies.Fixed(γ)` (priced at G's widths: γ = 3 of G = 4
at width 5); autoregressive decoding is one target forward per token.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import policies
from specjax.step_types import Proposal

__all__ = ["over_best", "settled", "simulate"]


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


@flax.struct.dataclass
class _Prices:
  """`StepCosts` as traced arrays: [W] target_ms, [] draft_ms and
  first_draft_ms (so that cost sets share one compiled simulation)."""

  target_ms: jax.Array
  draft_ms: jax.Array
  first_draft_ms: jax.Array


def _step(policy: policies.GammaPolicy, prices: _Prices, alpha: jax.Array,
          tokens: int, state: _State) -> _State:
  """One speculative step of every row, as `speculate_step` takes it, or
  the run of plain steps that a plain choice stands for, as the loop takes
  it (`policies.PlainRuns`)."""
  max_gamma = alpha.shape[0]
  widths = policies.verify_widths(max_gamma)
  active = state.generated < tokens  # [B]
  remaining = tokens - state.generated  # [B]
  budget = policy.budget(state.policy, active, remaining)  # [B]
  drafting = jnp.any(budget > 0)
  drafted = jnp.minimum(budget, policy.trim(state.policy, budget, active,
                                            remaining))  # [B]
  width = policies.width_index(widths, jnp.max(drafted) + 1)
  draft_ms = (policies.drafting_ms(jnp.max(budget), prices.first_draft_ms,
                                   prices.draft_ms)
              + policies.catch_up_ms(state.lag, prices.draft_ms,
                                     prices.target_ms, max_gamma))
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
  stepped = state.replace(
      policy=policy.update(state.policy, budget, proposal, num_accepted,
                           active),
      generated=state.generated + emitted,
      lag=jnp.where(drafting, 0, state.lag + 1),
      ms=state.ms + prices.target_ms[width]
      + jnp.where(drafting, draft_ms, 0.0))
  if not policy.plain_runs:  # asked before every step
    return stepped
  run = policy.plain_run(state.policy, active, remaining)
  # The loop's run of plain steps (`specjax.plain`), which ends early where
  # a row does.
  run = jnp.minimum(jnp.minimum(run, policies.LONGEST_PLAIN_RUN),
                    jnp.min(jnp.where(active, remaining, tokens)))
  ran = state.replace(
      policy=policy.after_plain(state.policy, run),
      generated=state.generated + jnp.where(active, run, 0),
      lag=state.lag + run, ms=state.ms + run * prices.target_ms[0])
  return jax.tree.map(lambda a, b: jnp.where(drafting, a, b), stepped, ran)


def _generation(policy: policies.GammaPolicy, prices: _Prices,
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
      functools.partial(_step, policy, prices, alpha, tokens), state)


@functools.partial(jax.jit, static_argnames=("batch", "tokens", "samples",
                                             "observe_first", "warm_after"))
def _simulate(policy, prices, alpha, batch, tokens, samples, key,
              observe_first, warm_after):
  run = functools.partial(_generation, prices=prices, alpha=alpha,
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


def simulate(policy: policies.GammaPolicy | None,
             costs: policies.StepCosts, *,
             alpha: float | Sequence[float], batch: int, tokens: int,
             samples: int = 256, seed: int = 0,
             observe_first: bool | None = None,
             warm_after: int = 0) -> float:
  """Mean predicted tokens/s of `policy` over `samples` generations.

  Args:
    policy: a `GammaPolicy` with γ_max at most `costs.max_gamma` (`Auto`'s
      equal to it); None: autoregressive decoding.
    costs: what each step costs at this batch size (`StepCosts`, G =
      `costs.max_gamma`).
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
    warm_after: generations run before the one timed, each starting from
      `policy.warm` of the state the one before it ended with.

  Returns:
    B · tokens / (mean time of a generation), in tokens per second.
  """
  max_gamma = costs.max_gamma
  alpha = jnp.asarray(_per_position(alpha, max_gamma))  # [G]
  if batch < 1 or tokens < 1 or samples < 1 or warm_after < 0:
    raise ValueError(f"batch, tokens and samples must be >= 1 and "
                     f"warm_after >= 0, got {batch}, {tokens}, {samples} "
                     f"and {warm_after}.")
  if len(costs.target_ms) != len(costs.widths):
    raise ValueError(f"costs.target_ms needs one time per width "
                     f"{costs.widths}, got {len(costs.target_ms)}.")
  if policy is None:
    return batch * 1e3 / float(costs.target_ms[0])
  if policy.max_gamma > max_gamma or (
      isinstance(policy, policies.Auto) and policy.max_gamma != max_gamma):
    raise ValueError(f"The policy's max_gamma={policy.max_gamma} does not "
                     f"fit costs of max_gamma={max_gamma}.")
  if observe_first is None:
    observe_first = costs.draft_ms > 0
  prices = _Prices(jnp.asarray(costs.target_ms, jnp.float32),
                   jnp.float32(costs.draft_ms),
                   jnp.float32(costs.first_draft_ms))
  ms = _simulate(policy, prices, alpha, batch, tokens, samples,
                 jax.random.PRNGKey(seed), bool(observe_first),
                 int(warm_after))
  return batch * tokens / (float(jnp.mean(ms)) / 1e3)


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


def over_best(policy: policies.GammaPolicy, costs: policies.StepCosts, *,
              alpha: float | Sequence[float], batch: int, tokens: int,
              gammas: Sequence[int] | None = None, samples: int = 256,
              seed: int = 0, observe_first: bool | None = None,
              warm_after: int = 0,
              truth: policies.StepCosts | None = None) -> float:
  """`policy`'s simulated tokens/s over the best fixed γ in hindsight.

  Args:
    policy: a `GammaPolicy`; `Auto` chooses by the costs it was created
      with.
    costs, alpha, batch, tokens, samples, seed, observe_first: as in
      `simulate`.
    warm_after: as in `simulate`, for `policy` only (a fixed γ learns
      nothing).
    gammas: the fixed γ to compare with (0: autoregressive decoding);
      default 0 to G.
    truth: the costs every step is priced by (default `costs`): how a
      policy fares on a table whose error it cannot see.

  Returns:
    simulate(policy) / max over γ of simulate(Fixed(γ)), all priced by
    `truth`.
  """
  truth = costs if truth is None else truth
  gammas = range(costs.max_gamma + 1) if gammas is None else gammas
  rate = lambda p, **kw: simulate(p, truth, alpha=alpha, batch=batch,
                                  tokens=tokens, samples=samples, seed=seed,
                                  observe_first=observe_first, **kw)
  return rate(policy, warm_after=warm_after) / max(
      rate(policies.Fixed(g) if g else None) for g in gammas)
