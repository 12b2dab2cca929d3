"""How much to speculate, chosen per step inside the compiled loop.

Shape letters (`specjax.shapes`): B batch, G = γ_max, W verification
widths.

A fixed γ pays for γ drafts and a (γ+1)-token target pass every step,
whether or not the drafts are accepted; at low acceptance, or at a batch
size where the target pass stops being memory-bound, that is slower than
plain decoding. A `GammaPolicy` picks, before each step, a draft budget
per row (0 to G). `speculate_step` then drafts only when some row's budget
is positive (`lax.cond`) and runs the target over the smallest compiled
width T in `widths` (1, 2, 3, 5, 9, ..., G+1) that holds the longest
proposal (`lax.switch`). T = 1 is a plain autoregressive step. Every branch
is the same exact verifier (`specjax.verify.verify`) on a truncated
proposal, so the output keeps the target's distribution whichever branch
runs, and nothing recompiles when the choice changes.

Two policies:

- `Heuristic`: transformers' schedule for assisted generation (its
  `num_assistant_tokens_schedule="heuristic"`): per row, the budget grows
  by 2 after a step in which every budgeted draft was accepted and shrinks
  by 1 (to no less than 1) otherwise. It never stops drafting.
- `Auto`: per row, a running estimate of the conditional acceptance at
  each draft position, and the measured cost of each target width and of
  a draft token (`specjax.tuning.cost`). The estimate is a ratio of
  exponentially decayed counts, accepted over verified, updated wherever
  the position was verified; position 1 starts from `prior` (as one
  decaying pseudo-observation), and a deeper position leans on the
  estimate of the position before it with the weight of one observation,
  so a position rarely reached (deep in a long match) is neither
  forgotten nor guessed from a fixed prior. Drafting is a batch-wide cost
  (every draft forward and the target pass run over all rows), so it picks
  the one budget K that maximises the predicted tokens per second of the
  batch,

      Σ_b E[τ_b](K) / (d(K) + t_target(width(K + 1))),

  with E[τ](K) = 1 + Σ_{i≤min(K, r_b - 1)} Π_{j≤i} a_j
  (`tuning.cost.expected_tokens`, capped where a row has only r_b tokens
  left to emit: drafts past its end are paid for and thrown away), and
  gives it to every active row; d(K) is the drafter's cost of K tokens, a
  first pass (the draft model's two-token catch-up) and K - 1 one-token
  forwards (`tuning.cost.ForwardCosts.drafting_ms`). K = 0 is an
  autoregressive step, and it is kept unless the best K predicts more
  than `margin` (3%) over it (`Auto.choose`): a gain that small is within
  the costs' and the estimates' own error, and where it is not real,
  drafting loses more than forgoing it does. That is the steady state.
  Near the end (no row with over `horizon` tokens left) the batch waits
  for its slowest row, whose step count spreads more the larger K is, so
  it then maximises the tokens left over the predicted time until the
  last row ends under a constant K (`specjax.finish`, exact), every row
  at the batch's pooled estimates (`Auto.pooled`: the rows' counts
  summed, the prior counted once). Once drafted, it verifies the K'
  leading drafts of each row that maximise the same prediction without
  the (spent) drafting cost and with each row's actual proposal length
  (`trim`); a drafter that costs nothing (prompt lookup) always drafts
  γ_max and is only trimmed, so a row without a match costs a plain
  step. After `probe_every` steps without drafting it tries one token,
  so the estimates follow a text that becomes predictable again. It also
  tries, without waiting, the budget that an upper confidence bound on position
  1's acceptance predicts best (`Auto.hoped`): the batch's pooled
  estimate plus `optimism` standard errors, √(a(1 - a) / (n + 1)) with n
  the steps that verified it in any row (not decayed), the deeper
  positions at their estimates; one token at most before any evidence.
  So a few unlucky rejections near the break-even (early in a generation
  the estimate rests on a few observations: after the prior and one
  acceptance, 0.85, two in a row bring it to 0.41) do not stop drafting for
  `probe_every` steps, a batch whose first probe was accepted goes on to
  the budget that pays (at B = 8, where one draft never pays, a wide
  one), while an estimate far below it, or one that many steps support,
  does not probe. Deeper positions get the same bound while it drafts: a
  position is observed only when a step drafts that deep, so where the
  bound on the position past the chosen budget (its own verifications,
  not decayed) predicts one more draft beats it, it drafts one more
  (`Auto.deepen`); a few early rejections then cannot hold it at one
  draft for good. A generation
  that starts from the prior tests it at once, so that where the prior
  alone does not pay (a draft model dear next to the target, as on a CPU
  without wide vector units) the estimates still come to rest on
  observations instead of never being tested: a draft model's prefill
  computes its guess at the target's first token anyway, so every row
  observes position 1 once before the first step, for free (`observe`:
  Σ min(p, q) of the two first-token distributions); a drafter without
  that guess probes at the first step. A probe is not
  free: beyond a plain step it pays a draft token (the first pass), a
  two-token target pass and the draft model's catch-up on every token it
  skipped, ⌈idle / (G+1)⌉ passes of G+1 tokens after `idle` plain steps
  (priced at the draft's one-token cost times the target's width ratio).
  So the wait is stretched to at least that predicted price, at the steps
  idle by the time it fires, in plain steps times the wait, which keeps
  the probes' share of the time at about 1/`probe_every` whatever the
  batch size. Where the catch-up alone grows by more than 1/wait of a
  plain step per step skipped, no wait is long enough and no scheduled
  probe is made (at B = 1 on a 2-core CPU, a draft model a third of the
  target: its catch-up is 7-9% of a plain step per token skipped, over
  the 6% that `probe_every` = 16 allows); each probe after which the
  policy still does not draft doubles the wait, up to `probe_max` steps,
  and the first step it drafts of its own accord resets it (exponential
  backoff). A probe is made only where it could pay for itself before the
  rows end: the time that drafting with certain acceptance would save over
  the tokens they have left must exceed its price (on a short generation,
  or at a batch size where drafting barely pays even then, a probe is a
  sure loss). `Auto.warm` starts a
  next generation from all that an earlier one observed
  (`SpecOutput.policy_state`), so short generations do not each pay for
  relearning from the prior. Where even
  certain acceptance is predicted not to pay (`Auto.may_draft`: a model
  drafter at a batch size where the wide pass is compute-bound), no step
  could ever draft, and `speculative_generate` falls back, before
  compiling, to `generate` itself: no draft prefill, no probes, and none
  of the speculative loop's per-step work.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import finish
from specjax.drafters.base import cost_model
from specjax.drafters.base import Proposal

__all__ = ["Auto", "GammaPolicy", "Heuristic", "PolicyState", "catch_up_ms",
           "drafting_ms", "verify_widths"]


def verify_widths(max_gamma: int) -> tuple[int, ...]:
  """Target chunk lengths T compiled for a γ_max: 1, then 2^i + 1 below
  G + 1, then G + 1 (e.g. G = 8: 1, 2, 3, 5, 9)."""
  if isinstance(max_gamma, bool) or int(max_gamma) != max_gamma or (
      max_gamma < 1):
    raise ValueError(f"max_gamma must be an integer >= 1, got {max_gamma!r}.")
  widths = {1, max_gamma + 1}
  step = 1
  while step + 1 < max_gamma + 1:
    widths.add(step + 1)
    step *= 2
  return tuple(sorted(widths))


def drafting_ms(num_drafts: jax.Array, first_draft_ms: jax.Array,
                draft_ms: jax.Array) -> jax.Array:
  """[...] predicted ms a draft model spends drafting `num_drafts` [...]
  tokens: its first (catch-up) pass, then a forward per further token; 0
  for none (`tuning.cost.ForwardCosts.drafting_ms` on the host)."""
  return jnp.where(num_drafts > 0,
                   first_draft_ms + (num_drafts - 1) * draft_ms, 0.0)


def catch_up_ms(idle: jax.Array, draft_ms: jax.Array, target_ms: jax.Array,
                max_gamma: int) -> jax.Array:
  """[] predicted ms a draft model spends catching up on the `idle` tokens
  plain steps emitted without it: ⌈idle / (G+1)⌉ passes of G+1 tokens,
  each priced at its one-token forward (`draft_ms`) times the target's
  ratio t(G+1) / t(1) (`target_ms` [W])."""
  return (jnp.ceil(idle / (max_gamma + 1)) * draft_ms * target_ms[-1]
          / target_ms[0])


def width_index(widths: Sequence[int], num_tokens: jax.Array) -> jax.Array:
  """Index of the smallest width >= num_tokens ([...] int32)."""
  return jnp.searchsorted(jnp.asarray(widths, jnp.int32), num_tokens,
                          side="left").astype(jnp.int32)


@flax.struct.dataclass(kw_only=True)
class PolicyState:
  """What a policy carries between steps.

  Attributes:
    budget: [B] int32 the heuristic's current draft budget per row.
    verified: [B, G] float32 decayed count of steps in which each draft
      position was verified, per row (`Auto`).
    accepted: [B, G] float32 the same count of acceptances (`Auto`).
    seen_verified: [B, G] float32 the steps of this generation in which
      each draft position was verified, not decayed (`Auto.warm`; position
      1's are the evidence behind `Auto.hoped`'s confidence bound).
    seen_accepted: [B, G] float32 the same count of acceptances.
    idle: [] int32 consecutive steps without drafting (`Auto`).
    wait: [] int32 steps without drafting before the next probe (`Auto`).
  """

  budget: jax.Array
  verified: jax.Array
  accepted: jax.Array
  seen_verified: jax.Array
  seen_accepted: jax.Array
  idle: jax.Array
  wait: jax.Array


class GammaPolicy:
  """Chooses each step's per-row draft budget; see the module docstring.

  Subclasses are `flax.struct.dataclass`es: `max_gamma` is static (it fixes
  the compiled shapes), the rest is traced.
  """

  max_gamma: int

  @property
  def widths(self) -> tuple[int, ...]:
    return verify_widths(self.max_gamma)

  def init(self, batch: int) -> PolicyState:
    raise NotImplementedError

  def budget(self, state: PolicyState, active: jax.Array,
             remaining: jax.Array | None = None) -> jax.Array:
    """[B] int32 draft budget in [0, G] for the next step (0 where
    inactive); `remaining` [B] is the tokens each row may still emit, or
    None for no limit."""
    raise NotImplementedError

  def trim(self, state: PolicyState, num_drafted: jax.Array,
           active: jax.Array, remaining: jax.Array | None = None
           ) -> jax.Array:
    """[B] int32 how many of the `num_drafted` [B] drafts to verify, once
    drafted (default: all)."""
    del state, active, remaining
    return num_drafted

  def warm(self, state: PolicyState) -> "GammaPolicy":
    """The policy for a next generation, given the `PolicyState` an
    earlier one ended with (default: unchanged)."""
    del state
    return self

  def may_draft(self) -> bool:
    """Host-side, before compiling: False if no step of a generation would
    ever draft, whatever the acceptance (default: True)."""
    return True

  def update(self, state: PolicyState, budget: jax.Array,
             proposal: Proposal, num_accepted: jax.Array,
             active: jax.Array) -> PolicyState:
    """Learns from one step: `budget` [B] as chosen, the proposal, and
    `num_accepted` [B] for rows where `active` [B]."""
    raise NotImplementedError

  def observe(self, state: PolicyState, accepted: jax.Array,
              active: jax.Array) -> PolicyState:
    """Learns from one observation of draft position 1 per row that no
    step paid for: `accepted` [B] float32 in [0, 1], the probability that
    a first draft would have been accepted (or a draw of it), where
    `active` [B] (default: ignored)."""
    del accepted, active
    return state


def _usable(remaining: jax.Array | None) -> jax.Array | None:
  """[B] drafts that can still count: a row with r tokens left emits at
  most r - 1 drafts and one target token."""
  return None if remaining is None else jnp.maximum(remaining - 1, 0)


def _reached(proposal: Proposal, num_accepted: jax.Array,
             active: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[B, G] bool: positions the target judged (every earlier one accepted),
  and those it accepted."""
  slots = jnp.arange(proposal.tokens.shape[1])[None]
  judged = (active[:, None] & (slots < proposal.num_drafted[:, None])
            & (slots <= num_accepted[:, None]))
  return judged, judged & (slots < num_accepted[:, None])


@flax.struct.dataclass
class Heuristic(GammaPolicy):
  """transformers' heuristic schedule: +2 after a fully accepted budget,
  -1 (to no less than 1) otherwise, per row, starting at `initial`
  (default G) and capped at G."""

  max_gamma: int = flax.struct.field(pytree_node=False)
  initial: int = flax.struct.field(pytree_node=False, default=0)

  def __post_init__(self):
    verify_widths(self.max_gamma)
    if not 0 <= self.initial <= self.max_gamma:
      raise ValueError(f"initial must be in [1, max_gamma={self.max_gamma}]"
                       f" (0 for max_gamma), got {self.initial}.")

  def init(self, batch):
    start = self.initial or self.max_gamma
    none = jnp.zeros((batch, 0), jnp.float32)
    return PolicyState(budget=jnp.full((batch,), start, jnp.int32),
                       verified=none, accepted=none,
                       seen_verified=none, seen_accepted=none,
                       idle=jnp.int32(0), wait=jnp.int32(0))

  def budget(self, state, active, remaining=None):
    del remaining
    return jnp.where(active, state.budget, 0)

  def update(self, state, budget, proposal, num_accepted, active):
    tried = active & (proposal.num_drafted > 0)
    grown = jnp.where(num_accepted >= budget, state.budget + 2,
                      state.budget - 1)
    return state.replace(budget=jnp.where(
        tried, jnp.clip(grown, 1, self.max_gamma), state.budget))


@flax.struct.dataclass
class Auto(GammaPolicy):
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
    first_wait: [] int32 the wait before a generation's first probe: 0
      from the prior (`create`, unless `probe_first=False`), so the first
      step drafts at least one token unless the rows observed position 1
      at prefill (`observe`); `probe_every` from learned estimates
      (`warm`).
    optimism: [] float32 standard errors added to position 1's estimate
      to decide whether a plain step should probe at once (`hoped`; 0:
      only the scheduled probes).
    margin: [] float32 the predicted gain over a plain step that drafting
      must exceed, as a fraction (`choose`).
    max_gamma: G, static.
    horizon: static, the most tokens a row may have left for the budget to
      be chosen by when the batch ends (`score`); 0 for the steady state
      only.
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
  first_wait: jax.Array
  optimism: jax.Array
  margin: jax.Array
  max_gamma: int = flax.struct.field(pytree_node=False)
  horizon: int = flax.struct.field(pytree_node=False, default=64)
  serial_finish: bool | None = flax.struct.field(pytree_node=False,
                                                 default=None)

  @classmethod
  def create(cls, *, max_gamma: int, target_ms: Sequence[float],
             draft_ms: float = 0.0, first_draft_ms: float | None = None,
             prior: float = 0.7, rate: float = 0.05, probe_every: int = 16,
             probe_max: int = 128, probe_first: bool = True,
             optimism: float = 1.0, margin: float = 0.03, horizon: int = 64,
             serial_finish: bool | None = None) -> "Auto":
    """Validates host values.

    Args:
      max_gamma: G.
      target_ms: ms of a target pass of each width in `verify_widths(G)`.
      draft_ms: ms per drafted token after a step's first.
      first_draft_ms: ms of a step's first draft token (default
        `draft_ms`).
      prior: initial acceptance estimate in [0, 1], of position 1 (one
        pseudo-observation; deeper positions inherit it until observed).
      rate: moving-average weight of a new observation, in (0, 1].
      probe_every: steps without drafting before a one-token probe, >= 1.
      probe_max: the longest wait between probes that find drafting still
        not worth it (each doubles the wait), >= probe_every.
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
    """
    widths = verify_widths(max_gamma)
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
               first_wait=jnp.int32(0 if probe_first else probe_every),
               optimism=jnp.float32(optimism), margin=jnp.float32(margin),
               max_gamma=int(max_gamma),
               horizon=int(horizon), serial_finish=serial_finish)

  @classmethod
  def measure(cls, target: Any, drafter: Any, *, batch: int,
              max_gamma: int, cache_size: int = 512,
              cache_dir: str | None = None, **kwargs) -> "Auto":
    """`create` with costs measured on this machine (`tuning.cost.measure`,
    cached on disk per machine, model, B, S and widths, re-timed at their
    first use in a process and again from time to time while in use, each
    table the mean of its last passes), at the cache size S the
    generation runs with (a forward's cost grows with S).

    A drafter's per-token cost is one forward of its `cost_model` (the
    draft model; none for prompt lookup), and a two-token forward for a
    step's first token (`ForwardCosts.drafting_ms`). For a `Fallback` that
    is its second drafter's model, an upper bound; for a `Cascade`, its
    middle model's forward, which ignores the inner drafter's work.
    """
    from specjax.tuning import cost  # the cost module imports decode
    widths = verify_widths(max_gamma)
    target_costs = cost.measure(target, batch=batch, chunks=widths,
                                cache_size=cache_size, cache_dir=cache_dir)
    model = cost_model(drafter)
    draft = {}
    if model is not None:
      draft = cls.draft_costs(cost.measure(
          model, batch=batch, chunks=(1, 2), cache_size=cache_size,
          cache_dir=cache_dir))
    return cls.create(max_gamma=max_gamma,
                      target_ms=[target_costs.at(w) for w in widths],
                      **draft, **kwargs)

  def priced(self, target_ms: Sequence[float], draft_ms: float = 0.0,
             first_draft_ms: float | None = None) -> "Auto":
    """This policy (cold or `warm`) with other costs, as `create` takes
    them: e.g. a cost table timed again since (`tuning.cost.measure`),
    for a server that keeps a warm policy from request to request. Same
    shapes, so nothing recompiles."""
    new = Auto.create(max_gamma=self.max_gamma, target_ms=target_ms,
                      draft_ms=draft_ms, first_draft_ms=first_draft_ms)
    return self.replace(target_ms=new.target_ms, draft_ms=new.draft_ms,
                        first_draft_ms=new.first_draft_ms)

  @staticmethod
  def draft_costs(costs: Any) -> dict[str, float]:
    """`create`'s draft_ms and first_draft_ms from a draft model's
    `tuning.cost.ForwardCosts`."""
    return {"draft_ms": costs.at(1), "first_draft_ms": costs.drafting_ms(1)}

  def init(self, batch):
    shape = (batch, self.max_gamma)
    return PolicyState(
        budget=jnp.zeros((batch,), jnp.int32),
        verified=jnp.broadcast_to(self.start_verified, shape),
        accepted=jnp.broadcast_to(self.start_accepted, shape),
        seen_verified=jnp.zeros(shape, jnp.float32),
        seen_accepted=jnp.zeros(shape, jnp.float32),
        idle=jnp.int32(0), wait=self.first_wait)

  def warm(self, state: PolicyState) -> "Auto":
    """This policy, with every row of the next generation starting from
    what an earlier one learned (`state`, e.g. `SpecOutput.policy_state`):
    a server keeps what it learned about its drafter on its workload
    instead of restarting from the prior at each request.

    The estimates carried are the earlier generation's undecayed ones:
    every row's observations (`seen_verified`, `seen_accepted`) pooled
    with the counts it started from (as its pool counted them), not the
    rows' decayed counts at its end, which rest on their last
    1 / `rate` or so observations. From one short generation those few
    can be unlucky (at B = 1, α = 0.8, a few rejections near the end), and
    a start that trusted them might not draft for a whole next
    generation. Each row starts from these pooled estimates with the
    weight a row held, its start counts and its share of the
    observations, up to a steady decayed count (1 / `rate` observations
    of position 1), so that its own observations move them as fast as
    any decayed estimate. The batch's pool counts them as the evidence of
    all the rows that learned them (`start_rows`), not of one, and
    `start_trials` carries a row's steps behind position 1, for `hoped`'s
    bound. The estimates rest on observations, so there is no probe at the
    first step. Same shapes, so nothing recompiles.
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

  def acceptance(self, state: PolicyState) -> jax.Array:
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

  def pooled(self, state: PolicyState, active: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """The batch's estimates, [G], from its rows' counts summed, and the
    verifications behind them, [G] (`evidence`; position 1's: the steps
    that verified it in some row).

    The rows are the active ones and those that have ended after
    verifying something: the rows still running near the end are the
    ones whose drafts were rejected more (that is why they lag), so a pool
    of them alone would be biased low exactly when the finish time is
    chosen by it.

    Each row holds a decayed copy of the counts it started from (the
    prior, or what `warm` carried), which in a pool would be counted B
    times and outweigh the batch's first observations: after one
    accepted one-token probe at B = 8 from a prior of 0.7, 0.854 where
    the pool says 0.968 (at the default rate). So the start counts are
    counted once, at the rows' mean decay, (1 - rate)^n for a row that
    verified position 1 n times (a deeper position decays no faster, so
    its copy is at least that), times the rows they stand for
    (`start_rows`: 1 for the prior, an earlier batch's B after `warm`,
    whose pool they continue).
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

  def may_draft(self) -> bool:
    """False when even drafts that are always accepted are predicted to
    emit fewer tokens per ms than a plain step at these costs (a model
    drafter at a batch size where the target's wide pass is
    compute-bound). No acceptance estimate or probe can then make a step
    draft, and `speculative_generate` decodes autoregressively."""
    certain = jnp.ones((1, self.max_gamma), jnp.float32)
    rate = self.predicted_rate(certain, jnp.ones((1,), bool))  # [G+1]
    return bool(self.choose(rate) > 0)

  def choose(self, rate: jax.Array, most: jax.Array | int | None = None
             ) -> jax.Array:
    """[] int32 the budget K that `rate` [G+1] (predicted tokens per ms,
    K = 0..G) puts first among K = 1..`most` (default G), or 0 where its
    rate does not beat a plain step's by more than `margin`.

    The costs are means of standalone forwards timed at other moments
    than the steps they price, on a machine whose speed drifts by several
    percent between minutes; and the acceptance estimates rest on few
    observations. A predicted gain of a few percent is within both
    errors, and where it is not real drafting loses: at B = 2 on machine
    B a table priced one draft at α = 0.5 at 1.10x a plain step, and
    `gamma="auto"` ran at 0.90x autoregressive decoding, which no fixed
    γ beat (BENCHMARKS.md). Forgoing a true gain under `margin` costs at
    most margin / (1 + margin) of the best. Simulated over the sweep's
    cost tables at B = 1, 2, 4 and 8, with the drafting steps' true costs
    up to 10% off the table either way (`tuning.simulate`,
    BENCHMARKS.md), a margin of 3% raised the worst cell over no margin,
    cold and warm (0.942 to 0.951, 0.971 to 0.974), for 0.1% of the
    mean; 5% raised the cold one more and lowered the warm one; 8% and
    12% lowered both."""
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

  def _due(self, state: PolicyState) -> jax.Array:
    """[] bool: enough plain steps for a probe: `wait` of them, stretched
    to `wait` times the probe's price in plain steps. The price is the
    catch-up on the steps idle so far, or on `wait` of them before that:
    the probe fires later than `wait` wherever its price exceeds a plain
    step, and pays the catch-up on every step skipped by then."""
    plain = self.target_ms[0]
    return state.idle * plain >= state.wait * jnp.maximum(
        plain, self.probe_ms(jnp.maximum(state.idle, state.wait)))

  def _pays_back(self, state: PolicyState, active: jax.Array,
                 remaining: jax.Array | None) -> jax.Array:
    """[] bool: drafting every step with certain acceptance would save
    more time over the tokens the active rows have left (`remaining` [B],
    None for no end) than a probe now costs beyond a plain step, and
    would be drafted at all (`choose`, the margin). Where it would not, no
    probe can pay for itself before the generation ends."""
    if remaining is None:
      return jnp.bool_(True)
    certain = jnp.ones_like(state.accepted)
    rate = self.predicted_rate(certain, active, _usable(remaining))  # [G+1]
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
    widens (at B = 32, 32 tokens, machine G's costs and α = 0.5, one draft
    is 1.06x a plain step in the steady state and 0.91x for the whole
    generation). It gives every row the batch's estimates (`pooled`): the
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

  def hoped(self, state: PolicyState, active: jax.Array,
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
    pooled, evidence = self.pooled(state, active)  # [G], [G]
    rate = self._score_bound(state, pooled, evidence, 0, active, remaining,
                             available)  # [G+1]
    return self.choose(rate, jnp.where(evidence[0] > 0, self.max_gamma, 1))

  def _score_bound(self, state: PolicyState, pooled: jax.Array,
                   evidence: jax.Array, position: jax.Array | int,
                   active: jax.Array, remaining: jax.Array | None,
                   available: jax.Array | None,
                   drafting: bool = True) -> jax.Array:
    """[G+1] `score` for every row at the batch's estimates `pooled` [G],
    with the one at `position` (0-based) raised to its upper confidence
    bound a + `optimism` · √(a(1 - a) / (n + 1)), n its `evidence` [G]."""
    error = jnp.sqrt(pooled * (1.0 - pooled) / (evidence + 1.0))
    bound = jnp.where(jnp.arange(self.max_gamma) == position,
                      jnp.minimum(pooled + self.optimism * error, 1.0),
                      pooled)
    return self.score(jnp.broadcast_to(bound, state.verified.shape), bound,
                      active, remaining, available, drafting)

  def deepen(self, state: PolicyState, k: jax.Array, active: jax.Array,
             available: jax.Array | None = None,
             remaining: jax.Array | None = None,
             drafting: bool = True) -> jax.Array:
    """[] the budget `k`, or k + 1 where an upper confidence bound on the
    acceptance of position k + 1 predicts it beats `k` by more than
    `margin` (`score` at the batch's pooled estimates, position k + 1 at
    a + `optimism` · √(a(1 - a) / (n + 1)), n its verifications in the
    batch, not decayed, and those its start counts stand for); only
    where `k` > 0 and position k has been verified at least once.

    A deeper position is observed only when a step drafts that deep, so an
    estimate that a few early rejections pulled under its break-even
    would otherwise never be tested again: at B = 2, α = 0.8 and machine
    B's costs, replayed on the tiny pair, `auto` warm-started from a
    generation whose position 2 was rejected once drafted one token a step
    for four generations where two pay (BENCHMARKS.md). Drafting one token
    deeper costs a draft forward and a slightly wider target pass, and the
    bound narrows as the position is observed, so a position whose
    acceptance is really low stops being tried.

    Args:
      state: the policy state.
      k: [] the budget chosen at the estimates.
      active: [B] rows that count.
      available, remaining: [B] as in `score`, or None.
      drafting: as in `predicted_rate`.
    """
    k = jnp.asarray(k, jnp.int32)

    def deeper():
      pooled, evidence = self.pooled(state, active)  # [G], [G]
      more = jnp.minimum(k + 1, self.max_gamma)
      rate = self._score_bound(state, pooled, evidence, more - 1, active,
                               remaining, available, drafting)  # [G+1]
      tested = evidence[k - 1] > 0
      return jnp.where((more > k) & tested
                       & (rate[more] > rate[k] * (1.0 + self.margin)),
                       more, k)

    # A plain step (k = 0) has no deeper position to try.
    return jax.lax.cond(k > 0, deeper, lambda: k)

  def evidence(self, state: PolicyState, active: jax.Array) -> jax.Array:
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

  def _probe(self, state: PolicyState, k: jax.Array, active: jax.Array,
             available: jax.Array | None,
             remaining: jax.Array | None) -> jax.Array:
    """[] the budget `k`, or where it is 0 a probe: the budget `hoped`
    for, else one token if one is due (`_due`); only where some active
    row can use a draft (`available` [B] drafts per row, None for any)
    and the tokens left (`remaining` [B]) could repay it (`_pays_back`)."""
    usable = True if available is None else jnp.any(active & (available > 0))
    # Only a plain step asks what the bound hopes for.
    hope = jax.lax.cond(
        k == 0, lambda: self.hoped(state, active, available,
                                   remaining).astype(jnp.int32),
        lambda: jnp.int32(0))
    probe = jnp.where(hope > 0, hope, self._due(state).astype(jnp.int32))
    allowed = usable & self._pays_back(state, active, remaining)
    return jnp.where((k == 0) & allowed, probe, k)

  def budget(self, state, active, remaining=None):
    # A drafter that costs nothing drafts all it can; `trim` then picks
    # how much of it to verify.
    usable = _usable(remaining)
    rate = self.score(self.acceptance(state),
                      self.pooled(state, active)[0], active, remaining,
                      usable)  # [G+1]
    k = self.deepen(state, self.choose(rate), active, usable, remaining)
    k = jnp.where(self.draft_ms > 0,
                  self._probe(state, k, active, usable, remaining),
                  self.max_gamma)
    return jnp.where(active, k, 0).astype(jnp.int32)

  def trim(self, state, num_drafted, active, remaining=None):
    """The drafts are paid for: verify the K' <= G leading ones of each row
    that maximise the predicted tokens per ms of the verification alone."""
    usable = _usable(remaining)
    if usable is not None:
      num_drafted = jnp.minimum(num_drafted, usable)

    def pick():
      k = self.choose(self.score(self.acceptance(state),
                                 self.pooled(state, active)[0], active,
                                 remaining, num_drafted, drafting=False))
      k = self.deepen(state, k, active, num_drafted, remaining,
                      drafting=False)
      return self._probe(state, k, active, num_drafted,
                         remaining).astype(jnp.int32)

    # Without drafts (a plain step) there is nothing to choose.
    k = jax.lax.cond(jnp.any(active & (num_drafted > 0)), pick,
                     lambda: jnp.int32(0))
    return jnp.where(active, k, 0).astype(jnp.int32)

  def _learn(self, state: PolicyState, judged: jax.Array,
             accepted: jax.Array) -> PolicyState:
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

  def observe(self, state, accepted, active):
    """Position 1's counts learn `accepted` as from a verified first draft
    (`_learn`, as `update` does), and the first-step probe it replaces is
    no longer due."""
    judged = active[:, None] & (jnp.arange(self.max_gamma)[None] == 0)
    return self._learn(state, judged,
                       accepted.astype(jnp.float32)[:, None]).replace(
                           wait=jnp.maximum(state.wait, self.probe_every))

  def update(self, state, budget, proposal, num_accepted, active):
    judged, accepted = _reached(proposal, num_accepted, active)
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
