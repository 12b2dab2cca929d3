"""How much to speculate: the `GammaPolicy` protocol and its simple members.

Shape letters (`specjax.shapes`): B batch, G = γ_max.

A `GammaPolicy` picks, before each step, a draft budget per row (0 to G).
`speculate_step` drafts only when some row's budget is positive and runs
the target over the smallest compiled width in `widths` that holds the
longest proposal. Every branch is the same exact verifier
(`specjax.verify.verify`) on a truncated proposal, so the output keeps the
target's distribution whatever a policy chooses, and nothing recompiles
when the choice changes.

The protocol is a small core, `GammaPolicy` (what the step asks,
`step_types.StepPolicy`, and a generation's `init`, `observe`, `warm`,
`may_draft`), and one optional extension, `PlainRuns`: a policy whose
plain choice stands for a run of plain steps, which the loop then takes at
`generate`'s cost (`specjax.plain`). A policy declares it by subclassing
`PlainRuns` (`plain_runs`); the loop never calls a policy to find out.
Each policy has its own state: None for `Fixed`, `HeuristicState`,
`estimates.AutoState`.

- `Fixed`: γ drafts every step, one compiled width (a fixed γ is just this
  policy).
- `Heuristic`: transformers' schedule for assisted generation (its
  `num_assistant_tokens_schedule="heuristic"`): per row, the budget grows
  by 2 after a step in which every budgeted draft was accepted and shrinks
  by 1 (to no less than 1) otherwise. It never stops drafting.
- `specjax.policies.auto.Auto`: the cost-model policy.
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from specjax.step_types import Proposal
from specjax.step_types import StepPolicy
from specjax.verify import verify_widths

__all__ = ["Fixed", "GammaPolicy", "Heuristic", "HeuristicState",
           "LONGEST_PLAIN_RUN", "PlainRuns", "PolicyState"]

# The most plain steps one choice may stand for (`PlainRuns.plain_run`).
LONGEST_PLAIN_RUN = 64

# A policy's state: the pytree its `init` returns, its own (None for
# `Fixed`, `HeuristicState`, `estimates.AutoState`).
PolicyState = Any


class GammaPolicy(StepPolicy):
  """Chooses each step's per-row draft budget: `init`, `budget`, `update`.

  Subclasses are `flax.struct.dataclass`es: `max_gamma` is static (it fixes
  the compiled shapes), the rest is traced. `widths` are the target pass
  widths the step compiles: all of `verify_widths(G)` by default (a budget
  of k verifies over the smallest width >= k + 1), one for `Fixed`.
  `budget`, `trim` and `update` are the step's (`step_types.StepPolicy`).

  Attributes:
    plain_runs: declared by `PlainRuns`: a plain choice stands for a run
      of plain steps (False here: the loop asks before every step).
  """

  plain_runs: ClassVar[bool] = False

  @property
  def widths(self) -> tuple[int, ...]:
    return verify_widths(self.max_gamma)

  def init(self, batch: int) -> PolicyState:
    """The policy's state for a generation of B rows (a pytree)."""
    raise NotImplementedError

  def warm(self, state: PolicyState) -> "GammaPolicy":
    """The policy for a next generation, given the state an earlier one
    ended with (default: unchanged)."""
    del state
    return self

  def may_draft(self, max_new_tokens: int | None = None,
                prefill_ms: float = 0.0) -> bool:
    """Host-side, before compiling: False if no step of a generation of
    `max_new_tokens` per row (None: no end) would ever draft, whatever the
    acceptance, or drafting could not repay the `prefill_ms` the
    drafter's model spends on the prompt (default: True)."""
    del max_new_tokens, prefill_ms
    return True

  def observe(self, state: PolicyState, accepted: jax.Array,
              active: jax.Array) -> PolicyState:
    """Learns from one observation of draft position 1 per row that no
    step paid for: `accepted` [B] float32 in [0, 1], the probability that
    a first draft would have been accepted (or a draw of it), where
    `active` [B] (default: ignored)."""
    del accepted, active
    return state


class PlainRuns(GammaPolicy):
  """A `GammaPolicy` whose plain choice stands for a run of plain steps:
  once `budget` chose a plain step for every row, the loop asks
  `plain_run` how many, takes them at `generate`'s cost (`specjax.plain`)
  and tells the state (`after_plain`)."""

  plain_runs: ClassVar[bool] = True

  def plain_run(self, state: PolicyState, active: jax.Array,
                remaining: jax.Array | None = None) -> jax.Array:
    """Once `budget` chose a plain step for every row: [] int32 in
    [1, `LONGEST_PLAIN_RUN`], the plain steps (this one included) after
    which nothing the choice reads can have changed but the tokens the
    rows emitted, so that the loop runs them and asks again after them
    (or once a row ends)."""
    raise NotImplementedError

  def after_plain(self, state: PolicyState, steps: jax.Array
                  ) -> PolicyState:
    """`state` after `steps` ([] int32) plain steps, as `update` would
    leave it after each."""
    raise NotImplementedError


@flax.struct.dataclass(kw_only=True)
class HeuristicState:
  """`Heuristic`'s state.

  Attributes:
    budget: [B] int32 each row's current draft budget.
  """

  budget: jax.Array


def usable_drafts(remaining: jax.Array | None) -> jax.Array | None:
  """[B] drafts that can still count: a row with r tokens left emits at
  most r - 1 drafts and one target token."""
  return None if remaining is None else jnp.maximum(remaining - 1, 0)


def reached(proposal: Proposal, num_accepted: jax.Array,
             active: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[B, G] bool: positions the target judged (every earlier one accepted),
  and those it accepted."""
  slots = jnp.arange(proposal.tokens.shape[1])[None]
  judged = (active[:, None] & (slots < proposal.num_drafted[:, None])
            & (slots <= num_accepted[:, None]))
  return judged, judged & (slots < num_accepted[:, None])


@flax.struct.dataclass
class Fixed(GammaPolicy):
  """γ = G drafts every step (a token tree: up to `num_nodes` nodes at
  depth at most G), verified in one pass of one compiled width. Its state
  is None."""

  max_gamma: int = flax.struct.field(pytree_node=False)
  num_nodes: int | None = flax.struct.field(pytree_node=False, default=None)

  def __post_init__(self):
    verify_widths(self.max_gamma)

  @property
  def widths(self) -> tuple[int, ...]:
    return ((self.num_nodes or self.max_gamma) + 1,)

  def init(self, batch):
    del batch
    return None

  def budget(self, state, active, remaining=None):
    del state, remaining
    return jnp.where(active, self.num_nodes or self.max_gamma,
                     0).astype(jnp.int32)

  def update(self, state, budget, proposal, num_accepted, active):
    return state


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
    return HeuristicState(budget=jnp.full((batch,), start, jnp.int32))

  def budget(self, state, active, remaining=None):
    del remaining
    return jnp.where(active, state.budget, 0)

  def update(self, state, budget, proposal, num_accepted, active):
    tried = active & (proposal.num_drafted > 0)
    grown = jnp.where(num_accepted >= budget, state.budget + 2,
                      state.budget - 1)
    return state.replace(budget=jnp.where(
        tried, jnp.clip(grown, 1, self.max_gamma), state.budget))


