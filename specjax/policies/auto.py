"""`Auto`: the cost-model γ policy.

Shape letters (`specjax.shapes`): B batch, G = γ_max, W verification
widths.

Per row it keeps a running estimate of the conditional acceptance at each
draft position (`Estimates`), and it prices steps by the forward costs of
each target width and of a draft token (`specjax.policies.costs.StepCosts`:
tuned tables or the roofline, never timed inside a call). Drafting is a
batch-wide cost, so before each step it picks the one budget K that
maximises the batch's predicted tokens per ms,

    Σ_b E[τ_b](K) / (d(K) + t_target(width(K + 1))),

E[τ](K) = 1 + Σ_{i≤min(K, r_b - 1)} Π_{j≤i} a_j, d(K) the drafter's cost
of K tokens. K = 0 is a plain step, kept unless the best K predicts more
than `margin` over it (`choose`). Around that core:

- near the end it prices when the slowest row ends (`finish_rate`);
- a plain step drafts what an upper confidence bound on position 1 hopes
  for (`hoped`): a few unlucky rejections do not stop drafting for long;
- while it takes plain steps it probes with one draft now and then, priced
  and backed off (`_due`, `probe_ms`, `_pays_back`): the estimates learn
  only from drafted steps;
- once drafted, it verifies only the leading drafts that pay (`trim`).

`observe` takes a draft model's prefill guess at the first token for free;
`warm` starts a generation from what an earlier one learned; `may_draft`
lets `speculative_generate` run `generate` where drafting could never pay.
Design: docs/policies.md; figures: BENCHMARKS.md, "Never slower".
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import finish
from specjax.policies.base import LONGEST_PLAIN_RUN
from specjax.policies.base import PlainRuns
from specjax.policies.base import reached
from specjax.policies.base import usable_drafts
from specjax.policies.costs import catch_up_ms
from specjax.policies.costs import drafting_ms
from specjax.policies.costs import ForwardCosts
from specjax.policies.costs import StepCosts
from specjax.policies.estimates import AutoState
from specjax.policies.estimates import Estimates
from specjax.verify import verify_widths
from specjax.verify import width_index

__all__ = ["Auto", "PRIOR"]

# Acceptance assumed before any is measured: of position 1 for `Auto`, and
# of every position where a cost is priced ahead of a run.
PRIOR = 0.7


@flax.struct.dataclass
class Auto(Estimates, PlainRuns):
  """Cost-model-driven budget; see the module docstring.

  Attributes:
    target_ms: [W] float32 ms of a target pass of each width in `widths`,
      at this batch size.
    draft_ms: [] float32 ms of each draft token after the first (0 for a
      drafter that runs no model).
    first_draft_ms: [] float32 ms of the first draft token of a step: the
      draft model's two-token catch-up pass.
    start_verified: [G] float32 the decayed counts every row starts
      from: one pseudo-observation of position 1 at `prior` (`create`), or
      what an earlier generation learned (`warm`).
    start_accepted: [G] float32 the matching acceptance counts.
    start_trials: [] float32 the steps that verified position 1 before
      the generation: 0 (`create`) or an earlier generation's (`warm`).
    start_rows: [] float32 how many rows' evidence the start counts stand
      for in the batch's pool (`pooled`): 1 for the prior, one
      pseudo-observation (`create`); the rows of the generation that
      learned them (`warm`).
    rate: [] float32 the weight of the newest observation: earlier counts
      decay by 1 - rate.
    probe_every: [] int32 draft one token after this many steps without
      drafting.
    probe_max: [] int32 the longest wait the backoff reaches.
    probe_price: [] float32 a probe's price beyond a plain step, in plain
      steps, above which it waits longer in proportion (`_due`).
    first_wait: [] int32 the wait before a generation's first probe: 0
      from the prior (`create`, unless `probe_first=False`), so the first
      step drafts at least one token unless the rows observed position 1
      at prefill (`observe`); `probe_every` from learned estimates
      (`warm`).
    optimism: [] float32 standard errors `hoped` adds (see `create`).
    margin: [] float32 the fractional gain drafting must beat (`choose`).
    max_gamma: G, static.
    compiled: static, the target pass widths compiled (`widths`): () for
      all of `verify_widths(G)`, or a subset from 1 to G + 1
      (`StepCosts.for_call` drops the widths that would cost about as much
      as the next larger one).
    horizon: static: once no row has more tokens left than this, `score`
      prices the batch's end (0: never).
    serial_finish: static, how `finish.expected_steps` computes the
      batch's end: in a loop (True), all at once (False), or by the
      backend (None).
  """

  target_ms: jax.Array
  draft_ms: jax.Array
  first_draft_ms: jax.Array
  start_verified: jax.Array
  start_accepted: jax.Array
  start_trials: jax.Array
  start_rows: jax.Array
  rate: jax.Array
  probe_every: jax.Array
  probe_max: jax.Array
  probe_price: jax.Array
  first_wait: jax.Array
  optimism: jax.Array
  margin: jax.Array
  max_gamma: int = flax.struct.field(pytree_node=False)
  compiled: tuple[int, ...] = flax.struct.field(pytree_node=False,
                                                default=())
  horizon: int = flax.struct.field(pytree_node=False, default=64)
  serial_finish: bool | None = flax.struct.field(pytree_node=False,
                                                 default=None)

  @classmethod
  def create(cls, *, max_gamma: int, target_ms: Sequence[float],
             draft_ms: float = 0.0, first_draft_ms: float | None = None,
             prior: float = PRIOR, rate: float = 0.05, probe_every: int = 16,
             probe_max: int = 128, probe_price: float = 0.25,
             probe_first: bool = True, optimism: float = 1.0,
             margin: float = 0.03, horizon: int = 64,
             serial_finish: bool | None = None,
             widths: Sequence[int] | None = None) -> "Auto":
    """Validates host values.

    Args:
      max_gamma: G.
      target_ms: ms of a target pass of each width in `widths`.
      draft_ms: ms per drafted token after a step's first.
      first_draft_ms: ms of a step's first draft token (default
        `draft_ms`).
      prior: initial acceptance estimate in [0, 1], of position 1 (one
        pseudo-observation; deeper positions inherit it until observed).
      rate: moving-average weight of a new observation, in (0, 1].
      probe_every: steps without drafting before a one-token probe, >= 1.
      probe_max: the longest wait between probes that find drafting still
        not worth it (each doubles the wait), >= probe_every.
      probe_price: a probe's price beyond a plain step, in plain steps,
        > 0, above which it waits longer in proportion: probes then take
        at most `probe_price` / `probe_every` of the time.
      probe_first: draft at least one token at the first step, whatever
        the prior predicts, so that the prior is tested at once (unless
        `observe` tested it at prefill).
      optimism: standard errors of position 1's estimate added to it to
        decide whether a plain step should probe at once, >= 0 (0: only
        the scheduled probes).
      margin: draft only where the predicted tokens per ms beat a plain
        step's by more than this fraction, >= 0 (see `choose`).
      horizon: choose by when the batch ends once no row has more than
        this many tokens left, >= 0 (0: by the steady state throughout).
      serial_finish: see the attribute (None: by the backend).
      widths: the target pass widths to compile, ascending from 1 to G + 1
        (default all of `verify_widths(G)`).
    """
    ladder = verify_widths(max_gamma)
    widths = ladder if widths is None else tuple(int(w) for w in widths)
    if (widths[0] != 1 or widths[-1] != max_gamma + 1
        or list(widths) != sorted(set(widths))):
      raise ValueError(f"widths must ascend from 1 to G + 1 = "
                       f"{max_gamma + 1}, got {widths}.")
    costs = np.asarray(target_ms, np.float32).reshape(-1)
    if costs.shape != (len(widths),) or not np.all(costs > 0):
      raise ValueError(f"target_ms needs one positive time per width "
                       f"{widths}, got {np.asarray(target_ms).tolist()}.")
    first_draft_ms = draft_ms if first_draft_ms is None else first_draft_ms
    if not (draft_ms >= 0 and first_draft_ms >= 0):
      raise ValueError(f"draft_ms and first_draft_ms must be >= 0, got "
                       f"{draft_ms} and {first_draft_ms}.")
    if not 0.0 <= prior <= 1.0:
      raise ValueError(f"prior must be in [0, 1], got {prior}.")
    if not 0.0 < rate <= 1.0:
      raise ValueError(f"rate must be in (0, 1], got {rate}.")
    if int(probe_every) < 1:
      raise ValueError(f"probe_every must be >= 1, got {probe_every}.")
    if not optimism >= 0:
      raise ValueError(f"optimism must be >= 0, got {optimism}.")
    if not margin >= 0:
      raise ValueError(f"margin must be >= 0, got {margin}.")
    if isinstance(horizon, bool) or int(horizon) != horizon or horizon < 0:
      raise ValueError(f"horizon must be an integer >= 0, got {horizon!r}.")
    if serial_finish is not None and not isinstance(serial_finish, bool):
      raise ValueError(f"serial_finish must be True, False or None, got "
                       f"{serial_finish!r}.")
    if not probe_price > 0:
      raise ValueError(f"probe_price must be > 0, got {probe_price}.")
    if int(probe_max) < int(probe_every):
      raise ValueError(f"probe_max must be >= probe_every={probe_every}, "
                       f"got {probe_max}.")
    first = jax.nn.one_hot(0, max_gamma, dtype=jnp.float32)
    return cls(target_ms=jnp.asarray(costs), draft_ms=jnp.float32(draft_ms),
               first_draft_ms=jnp.float32(first_draft_ms),
               start_verified=first, start_accepted=first * prior,
               start_trials=jnp.float32(0.0), start_rows=jnp.float32(1.0),
               rate=jnp.float32(rate),
               probe_every=jnp.int32(probe_every),
               probe_max=jnp.int32(probe_max),
               probe_price=jnp.float32(probe_price),
               first_wait=jnp.int32(0 if probe_first else probe_every),
               optimism=jnp.float32(optimism), margin=jnp.float32(margin),
               max_gamma=int(max_gamma),
               compiled=() if widths == ladder else widths,
               horizon=int(horizon), serial_finish=serial_finish)

  @classmethod
  def from_costs(cls, costs: StepCosts, **kwargs) -> "Auto":
    """`create` priced by `costs` (`StepCosts.for_call`, or timed by
    `specjax.tuning.cost.step_costs`); `kwargs` as `create` takes them."""
    return cls.create(**costs.policy_kwargs(), **kwargs)

  @property
  def widths(self) -> tuple[int, ...]:
    return self.compiled or verify_widths(self.max_gamma)

  def costs(self) -> StepCosts:
    """The `StepCosts` this policy prices steps by (host values)."""
    return StepCosts(max_gamma=self.max_gamma, widths=self.widths,
                     target_ms=tuple(map(float, self.target_ms)),
                     draft_ms=float(self.draft_ms),
                     first_draft_ms=float(self.first_draft_ms))

  def priced(self, target_ms: Sequence[float], draft_ms: float = 0.0,
             first_draft_ms: float | None = None) -> "Auto":
    """This policy (cold or `warm`) with other costs, as `create` takes
    them: e.g. a cost table timed again since (`tuning.cost.measure`),
    for a server that keeps a warm policy from request to request. Same
    shapes, so nothing recompiles."""
    new = Auto.create(max_gamma=self.max_gamma, target_ms=target_ms,
                      draft_ms=draft_ms, first_draft_ms=first_draft_ms,
                      widths=self.widths)
    return self.replace(target_ms=new.target_ms, draft_ms=new.draft_ms,
                        first_draft_ms=new.first_draft_ms)

  @staticmethod
  def draft_costs(costs: ForwardCosts) -> dict[str, float]:
    """`create`'s draft_ms and first_draft_ms from a draft model's
    `tuning.cost.ForwardCosts`."""
    return {"draft_ms": costs.at(1), "first_draft_ms": costs.drafting_ms(1)}

  def init(self, batch):
    shape = (batch, self.max_gamma)
    return AutoState(
        verified=jnp.broadcast_to(self.start_verified, shape),
        accepted=jnp.broadcast_to(self.start_accepted, shape),
        seen_verified=jnp.zeros(shape, jnp.float32),
        seen_accepted=jnp.zeros(shape, jnp.float32),
        idle=jnp.int32(0), wait=self.first_wait)

  def warm(self, state: AutoState) -> "Auto":
    """This policy, with every row of the next generation starting from
    what an earlier one learned (`state`, e.g. `SpecOutput.policy_state`):
    a server keeps what it learned about its drafter across requests.

    It carries the undecayed estimates, every row's observations
    (`seen_verified`, `seen_accepted`) pooled with the start counts, not
    the rows' decayed counts, which rest on the last 1 / `rate` or so
    observations and can be unlucky after a short generation. Each row
    holds them with at most a steady decayed weight (1 / `rate`
    observations of position 1), so its own observations still move them;
    the pool counts them as the evidence of all the rows that learned them
    (`start_rows`), and `start_trials` feeds `hoped`'s bound. No probe at
    the first step. Same shapes, so nothing recompiles.
    """
    state = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), state)
    rows = state.seen_verified.shape[0]
    # [G] all the earlier batch knew: its start counts (as its pool
    # counted them) and what its rows observed.
    known = lambda start, seen: start * self.start_rows + jnp.sum(seen, 0)
    total = known(self.start_verified, state.seen_verified)
    ratio = known(self.start_accepted, state.seen_accepted) / jnp.maximum(
        total, 1e-6)
    # What a row held, undecayed: its copy of the start and its share of
    # the observations; no more than a steady decayed count.
    verified = self.start_verified + jnp.mean(state.seen_verified, 0)
    verified *= jnp.minimum(1.0, 1.0 / (self.rate
                                        * jnp.maximum(verified[0], 1e-6)))
    return self.replace(start_verified=verified,
                        start_accepted=verified * ratio,
                        start_trials=self.start_trials
                        + jnp.mean(state.seen_verified[:, 0]),
                        start_rows=jnp.float32(rows),
                        first_wait=self.probe_every)

  def predicted_rate(self, acceptance: jax.Array, active: jax.Array,
                     available: jax.Array | None = None,
                     drafting: bool = True) -> jax.Array:
    """[G+1] predicted tokens per ms of the batch for each budget K = 0..G.

    Args:
      acceptance: [B, G] conditional acceptance estimates.
      active: [B] rows that count.
      available: [B] drafts that can count per row (those it already has,
        or those before its end), or None for as many as K.
      drafting: whether the K drafts are still to be paid for (before
        drafting) or already spent (choosing how many drafted tokens to
        verify).
    """
    survive = jnp.cumprod(acceptance, axis=1)  # [B, G]
    if available is not None:
      positions = jnp.arange(self.max_gamma)[None]
      survive = jnp.where(positions < available[:, None], survive, 0.0)
    expected = 1.0 + jnp.concatenate(
        [jnp.zeros_like(survive[:, :1]), jnp.cumsum(survive, axis=1)], 1)
    tokens = jnp.sum(jnp.where(active[:, None], expected, 0.0), 0)  # [G+1]
    k = jnp.arange(self.max_gamma + 1)
    step_ms = self.target_ms[width_index(self.widths, k + 1)]
    if drafting:
      step_ms = step_ms + drafting_ms(k, self.first_draft_ms, self.draft_ms)
    return tokens / step_ms

  def may_draft(self, max_new_tokens: int | None = None,
                prefill_ms: float = 0.0) -> bool:
    """False when drafting could never pay at these costs: drafts that
    are always accepted are predicted to emit fewer tokens per ms than a
    plain step (a model drafter at a batch size where the target's wide
    pass is compute-bound), or to save less over the call's
    `max_new_tokens` per row (None: no end) than the drafter's model
    spends on the prompt before the first step (`prefill_ms`: a draft
    model priced near its target). No acceptance estimate or probe can
    then make the call pay, and `speculative_generate` decodes
    autoregressively."""
    certain = jnp.ones((1, self.max_gamma), jnp.float32)
    rate = self.predicted_rate(certain, jnp.ones((1,), bool))  # [G+1]
    if not self.choose(rate) > 0:
      return False
    if max_new_tokens is None:
      return True
    saved = max_new_tokens * (1.0 / rate[0] - 1.0 / jnp.max(rate[1:]))
    return bool(saved > prefill_ms)

  def choose(self, rate: jax.Array, most: jax.Array | int | None = None
             ) -> jax.Array:
    """[] int32 the budget K that `rate` [G+1] (predicted tokens per ms,
    K = 0..G) puts first among K = 1..`most` (default G), or 0 where its
    rate does not beat a plain step's by more than `margin`.

    The costs are means of forwards timed apart from the steps they price,
    and the acceptance estimates rest on few observations, so a predicted
    gain of a few percent is within their error, and drafting on a gain
    that is not real loses. Forgoing a real gain under `margin` costs at
    most margin / (1 + margin) of the best (figures: BENCHMARKS.md, "Never
    slower")."""
    k = jnp.arange(self.max_gamma + 1)
    most = self.max_gamma if most is None else most
    best = jnp.argmax(jnp.where((k >= 1) & (k <= most), rate, -jnp.inf))
    return jnp.where(rate[best] > rate[0] * (1.0 + self.margin), best,
                     0).astype(jnp.int32)

  def probe_ms(self, idle: jax.Array) -> jax.Array:
    """[] predicted ms a one-token probe after `idle` plain steps costs
    beyond a plain step (see the module docstring)."""
    catch_up = catch_up_ms(idle, self.draft_ms, self.target_ms,
                           self.max_gamma)
    return (self.first_draft_ms + catch_up + self.target_ms[1]
            - self.target_ms[0])

  def _due(self, state: AutoState) -> jax.Array:
    """[] bool: `wait` plain steps have passed, stretched by the probe's
    price over `probe_price` plain steps where that exceeds one, so a probe
    costs at most `probe_price` / `wait` of the time before it. The price
    is the catch-up on max(idle, wait) steps: a dear probe fires late and
    pays the catch-up on every step skipped by then."""
    plain = self.target_ms[0]
    price = self.probe_ms(jnp.maximum(state.idle, state.wait))
    return state.idle * plain >= state.wait * jnp.maximum(
        plain, price / self.probe_price)

  def _pays_back(self, state: AutoState, active: jax.Array,
                 remaining: jax.Array | None) -> jax.Array:
    """[] bool: drafting every step with certain acceptance would save
    more time over the tokens the active rows have left (`remaining` [B],
    None for no end) than a probe now costs beyond a plain step, and
    would be drafted at all (`choose`, the margin). Where it would not, no
    probe can pay for itself before the generation ends."""
    if remaining is None:
      return jnp.bool_(True)
    certain = jnp.ones_like(state.accepted)
    rate = self.predicted_rate(certain, active,
                               usable_drafts(remaining))  # [G+1]
    tokens = jnp.sum(jnp.where(active, remaining, 0)).astype(jnp.float32)
    saved = tokens * (1.0 / jnp.maximum(rate[0], 1e-9)
                      - 1.0 / jnp.maximum(jnp.max(rate[1:]), 1e-9))
    return (self.choose(rate) > 0) & (saved > self.probe_ms(state.idle))

  def finish_rate(self, pooled: jax.Array, active: jax.Array,
                  remaining: jax.Array, drafting: bool = True) -> jax.Array:
    """[G+1] the active rows' tokens left over the predicted time until
    the slowest ends, for each budget K held to the end, every row at the
    batch's estimates `pooled` [G] (`remaining` [B] at most `horizon`; see
    `score`)."""
    # Every row alike: one distribution carried, [1, G+1, G+1].
    steps = finish.expected_steps(finish.emit_probabilities(pooled[None]),
                                  remaining, active, self.horizon,
                                  self.serial_finish)  # [G+1]
    k = jnp.arange(self.max_gamma + 1)
    target = self.target_ms[width_index(self.widths, k + 1)]
    step_ms = target + drafting_ms(k, self.first_draft_ms, self.draft_ms)
    # Drafts already made are spent: this step pays the target pass only.
    ms = (step_ms if drafting else target) + (steps - 1.0) * step_ms
    tokens = jnp.sum(jnp.where(active, remaining, 0)).astype(jnp.float32)
    return tokens / ms

  def score(self, acceptance: jax.Array, pooled: jax.Array,
            active: jax.Array, remaining: jax.Array | None = None,
            available: jax.Array | None = None,
            drafting: bool = True) -> jax.Array:
    """[G+1] predicted tokens per ms of the batch for each budget K.

    While some row has more than `horizon` tokens left (or with no end,
    `remaining` None), the steady state (`predicted_rate`). Once none has,
    the batch's end is near and its slowest row sets it: `finish_rate`,
    which prices the spread of the rows' step counts that a larger K
    widens, so a K the steady state favours can lose over the whole
    generation. It gives every row the batch's estimates (`pooled`): the
    max over rows would otherwise follow whichever row's estimate a recent
    rejection pulled down.

    Args:
      acceptance: [B, G] conditional acceptance estimates.
      pooled: [G] the batch's (`pooled`).
      active: [B] rows that count.
      remaining: [B] tokens each row may still emit, or None.
      available: [B] drafts each row has (once drafted) or could use
        (before its end), or None for as many as K.
      drafting: as in `predicted_rate`.
    """
    rate = self.predicted_rate(acceptance, active, available, drafting)
    if remaining is None or not self.horizon:
      return rate
    if available is not None:
      # The longest proposal a row has or can use caps K.
      most = jnp.max(jnp.where(active, available, 0))
      cap = lambda r: jnp.where(jnp.arange(self.max_gamma + 1) <= most, r,
                                0.0)
    else:
      cap = lambda r: r
    near = jnp.max(jnp.where(active, remaining, 0)) <= self.horizon
    return jax.lax.cond(
        near, lambda: cap(self.finish_rate(pooled, active, remaining,
                                           drafting)),
        lambda: rate)

  def hoped(self, state: AutoState, active: jax.Array,
            available: jax.Array | None = None,
            remaining: jax.Array | None = None) -> jax.Array:
    """[] the budget K that `score` predicts best at an upper confidence
    bound on position 1's acceptance (deeper positions at their
    estimates), 0 where none beats a plain step by more than `margin`
    (`choose`): a + `optimism` · √(a(1 - a) / (n + 1)), with a and n the
    batch's estimate and the steps that verified position 1 in its rows
    (`pooled`; not decayed; the 1 is the prior's pseudo-observation). The
    estimate follows recent steps (decayed counts); the bound's width
    falls with all the evidence, so a policy that keeps seeing a low
    acceptance stops hoping. Before any evidence it hopes for one token
    at most.

    Args:
      state: the policy state.
      active: [B] rows that count.
      available, remaining: [B] as in `score`, or None.
    """
    bound, evidence = self._bound(state, active)  # [G], [G]
    rate = self.score(jnp.broadcast_to(bound, state.verified.shape), bound,
                      active, remaining, available)  # [G+1]
    return self.choose(rate, jnp.where(evidence[0] > 0, self.max_gamma, 1))

  def _bound(self, state: AutoState, active: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """[G] the batch's estimates with position 1 at `hoped`'s upper
    bound, and [G] the evidence behind them (`pooled`)."""
    pooled, evidence = self.pooled(state, active)  # [G], [G]
    error = jnp.sqrt(pooled[0] * (1.0 - pooled[0]) / (evidence[0] + 1.0))
    return pooled.at[0].set(jnp.minimum(pooled[0] + self.optimism * error,
                                        1.0)), evidence

  def _probe(self, state: AutoState, k: jax.Array, active: jax.Array,
             available: jax.Array | None,
             remaining: jax.Array | None) -> jax.Array:
    """[] the budget `k`, or where it is 0 a probe: the budget `hoped`
    for, else one token if one is due (`_due`); only where some active
    row can use a draft (`available` [B], None for any) and the tokens
    left (`remaining` [B]) could repay it (`_may_probe`)."""
    # Only a plain step asks what the bound hopes for.
    hope = jax.lax.cond(
        k == 0, lambda: self.hoped(state, active, available,
                                   remaining).astype(jnp.int32),
        lambda: jnp.int32(0))
    probe = jnp.where(hope > 0, hope, self._due(state).astype(jnp.int32))
    allowed = self._may_probe(state, active, available, remaining)
    return jnp.where((k == 0) & allowed, probe, k)

  def _may_probe(self, state: AutoState, active: jax.Array,
                 available: jax.Array | None,
                 remaining: jax.Array | None) -> jax.Array:
    """[] bool: some active row can use a draft (`available` [B], None
    for any) and the tokens left could repay a probe (`_pays_back`)."""
    usable = True if available is None else jnp.any(active & (available > 0))
    return usable & self._pays_back(state, active, remaining)

  def budget(self, state, active, remaining=None):
    # A drafter that costs nothing drafts all it can; `trim` then picks
    # how much of it to verify.
    usable = usable_drafts(remaining)
    rate = self.score(self.acceptance(state),
                      self.pooled(state, active)[0], active, remaining,
                      usable)  # [G+1]
    k = jnp.where(self.draft_ms > 0,
                  self._probe(state, self.choose(rate), active, usable,
                              remaining),
                  self.max_gamma)
    return jnp.where(active, k, 0).astype(jnp.int32)

  def plain_run(self, state, active, remaining=None):
    """The plain steps a plain choice stands for (`PlainRuns.plain_run`).

    Over plain steps the estimates do not move; what does is `idle` (the
    run ends at the step a probe falls due, `_due`), the tokens left
    (which only lower what a probe could save, `_may_probe`, and hand the
    choice to `finish_rate` once no row has more than `horizon` left, so
    the run ends there) and the rows that end (which the loop watches).
    Within `horizon` of the end the choice stands where the steady state
    at `hoped`'s bound would not draft either, since `finish_rate`'s gain
    over K = 0 is at most `predicted_rate`'s (by Wald's identity the
    slowest row takes E[steps] >= its tokens / E[τ]); elsewhere the run
    is this one step.
    """
    steps = jnp.arange(1, LONGEST_PLAIN_RUN + 1)  # [R] runs of r steps
    due = self._due(state.replace(idle=state.idle + steps))  # [R]
    usable = usable_drafts(remaining)
    allowed = self._may_probe(state, active, usable, remaining)
    run = jnp.where(allowed & jnp.any(due), jnp.argmax(due) + 1,
                    LONGEST_PLAIN_RUN)
    if remaining is not None and self.horizon:
      most = jnp.max(jnp.where(active, remaining, 0))
      bound, _ = self._bound(state, active)
      steady = self.choose(self.predicted_rate(
          jnp.broadcast_to(bound, state.verified.shape), active, usable))
      run = jnp.where(most > self.horizon,
                      jnp.minimum(run, most - self.horizon),
                      jnp.where(steady > 0, 1, run))
    return jnp.maximum(run, 1).astype(jnp.int32)

  def after_plain(self, state, steps):
    return state.replace(idle=state.idle + steps)

  def trim(self, state, num_drafted, active, remaining=None):
    """The drafts are paid for: verify the K' <= G leading ones of each row
    that maximise the predicted tokens per ms of the verification alone."""
    usable = usable_drafts(remaining)
    if usable is not None:
      num_drafted = jnp.minimum(num_drafted, usable)

    def pick():
      k = self.choose(self.score(self.acceptance(state),
                                 self.pooled(state, active)[0], active,
                                 remaining, num_drafted, drafting=False))
      return self._probe(state, k, active, num_drafted,
                         remaining).astype(jnp.int32)

    # Without drafts (a plain step) there is nothing to choose.
    k = jax.lax.cond(jnp.any(active & (num_drafted > 0)), pick,
                     lambda: jnp.int32(0))
    return jnp.where(active, k, 0).astype(jnp.int32)

  def observe(self, state, accepted, active):
    """Position 1's counts learn `accepted` as from a verified first draft
    (`_learn`, as `update` does), and the first-step probe it replaces is
    no longer due."""
    judged = active[:, None] & (jnp.arange(self.max_gamma)[None] == 0)
    return self._learn(state, judged,
                       accepted.astype(jnp.float32)[:, None]).replace(
                           wait=jnp.maximum(state.wait, self.probe_every))

  def update(self, state, budget, proposal, num_accepted, active):
    judged, accepted = reached(proposal, num_accepted, active)
    drafted = jnp.any(active & (proposal.num_drafted > 0))
    # A step drafted once a probe was due was a probe: the next waits twice
    # as long, and at least `probe_every` after the first step's (it
    # resets once a step drafts of its own accord).
    probed = drafted & self._due(state)
    wait = jnp.where(
        probed, jnp.clip(2 * state.wait, self.probe_every, self.probe_max),
        jnp.where(drafted, self.probe_every, state.wait))
    return self._learn(state, judged, accepted.astype(jnp.float32)).replace(
        idle=jnp.where(drafted, 0, state.idle + 1), wait=wait)
