"""The speculative step's types: what flows between draft, verify and commit.

Shape letters (`specjax.shapes`): B batch, G = γ draft tokens per step (for
a token tree, T nodes at depth at most γ), V vocab, E hidden, Y
end-of-sequence ids, M = max(N_cap - 1, 1) most steps a generation can take,
W = N_cap + G + 1 output buffer width.

- `Proposal`: a drafter's tokens (and the q they were drawn from).
- `Verification`: the target's verdict on them.
- `StepParams`: the traced per-call settings.
- `SpecStats`: counters accumulated over a generation.
- `SpecState`: the speculative loop's state.
- `StepPolicy`: what the step asks of a γ policy.

Pure pytrees and a protocol; nothing here calls a model or loops.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import buffers
from specjax import sampling
from specjax import tree
from specjax.acceptance import Acceptance
from specjax.acceptance import Exact

__all__ = ["Proposal", "SpecState", "SpecStats", "StepParams",
           "StepPolicy", "Verification", "emitted_tokens"]


@flax.struct.dataclass(kw_only=True)
class Proposal:
  """Draft tokens for one speculative step.

  Attributes:
    tokens: [B, G] int32 drafted tokens (positions >= num_drafted are junk).
    q: [B, G, V] float32 distributions the tokens were drawn from, after the
      same sampling processing as the target's; None for a deterministic
      drafter (one-hot at each token; never materialised).
    num_drafted: [B] int32 in [0, G], how many leading tokens are proposed.
    num_forwards: [] int32 draft forward passes spent, or one count per
      component (`components`) for a drafter made of several (statistics
      only; 0 for a drafter that runs no model).
    parents: [B, G] int32 index of each token's parent among the drafts (-1:
      the last committed token), or None for a chain (parent of i is i - 1,
      `parent_indices`). Set, the proposal is a token tree of G = T nodes
      in topological order (`specjax.tree`); q, if given, is then the law
      each node was drawn from given its earlier siblings.
    depth: [B, T] int32 each tree node's depth (1 for the root's
      children), or None (computed from `parents` when needed).
    valid: [B, T] bool tree nodes that exist, or None: the first
      `num_drafted`.
    tree_depth: static, the deepest a tree's nodes may be (γ); 0 for a
      chain, whose depth is G.
  """

  tokens: jax.Array
  num_drafted: jax.Array
  num_forwards: jax.Array
  q: jax.Array | None = None
  parents: jax.Array | None = None
  depth: jax.Array | None = None
  valid: jax.Array | None = None
  tree_depth: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def max_depth(self) -> int:
    """γ: the deepest draft position (G for a chain)."""
    return self.tree_depth or self.tokens.shape[1]

  def node_mask(self) -> jax.Array:
    """[B, G] bool drafts that exist."""
    if self.valid is not None:
      return self.valid
    slots = jnp.arange(self.tokens.shape[1])[None]
    return slots < self.num_drafted[:, None]

  def node_depths(self) -> jax.Array:
    """[B, T] int32 tree node depths: `depth`, or computed from `parents`
    (a tree only)."""
    return self.depth if self.depth is not None else tree.depths(
        self.parents)

  def drafted_depths(self) -> jax.Array:
    """[B, γ] bool: whether some draft sits at depth d + 1."""
    if self.parents is None:
      return self.node_mask()
    levels = jnp.arange(1, self.max_depth + 1)[None, None]  # [1, 1, γ]
    return jnp.any(self.node_mask()[..., None]
                   & (self.node_depths()[..., None] == levels), axis=1)

  def parent_indices(self) -> jax.Array:
    """[B, G] int32 parents, the chain i - 1 when `parents` is None."""
    if self.parents is not None:
      return self.parents
    batch, gamma = self.tokens.shape
    return jnp.broadcast_to(jnp.arange(-1, gamma - 1, dtype=jnp.int32),
                            (batch, gamma))


@flax.struct.dataclass(kw_only=True)
class Verification:
  """The target's verdict on a proposal.

  Attributes:
    num_accepted: [B] int32 leading draft tokens accepted.
    next_token: [B] int32 the token sampled after them (the correction on a
      rejection, a bonus token when all were accepted).
    emitted: [B, G+1] int32 what the step commits: the accepted drafts, then
      `next_token` (repeated past it).
    logits: [B, G+1, V] float32 the target's logits after the last committed
      token and after each draft.
    probs: [B, G+1, V] float32 the same after sampling processing (p).
    hidden: [B, G+1, E] the target's last hidden states at those positions,
      or None for a model that does not expose them.
    path: [B, G] int32 for a token tree, the accepted nodes' chunk indices
      (node + 1) by depth, the unaccepted tail 0 (`tree.path_slots`), so a
      tree drafter can keep the path it drafted (`DraftModel.commit`);
      None for a chain.
    experts: [] int32 for a mixture-of-experts target, the distinct
      experts its pass woke, summed over layers (`ModelOutput.experts`);
      else None.
  """

  num_accepted: jax.Array
  next_token: jax.Array
  emitted: jax.Array
  logits: jax.Array
  probs: jax.Array
  hidden: jax.Array | None = None
  path: jax.Array | None = None
  experts: jax.Array | None = None

  @property
  def num_emitted(self) -> jax.Array:
    """[B] int32 tokens committed: the accepted drafts and the next token."""
    return self.num_accepted + 1


def emitted_tokens(drafts: jax.Array, num_accepted: jax.Array,
                   next_token: jax.Array) -> jax.Array:
  """[B, G] drafts, [B] accepted counts and next tokens -> [B, G+1] emitted
  (accepted drafts, then the next token, repeated past it)."""
  slots = jnp.arange(drafts.shape[1] + 1)[None]
  padded = jnp.concatenate([drafts, next_token[:, None]], axis=1)
  return jnp.where(slots < num_accepted[:, None], padded, next_token[:, None])


@flax.struct.dataclass(kw_only=True)
class SpecStats:
  """Counters accumulated over a generation.

  Attributes:
    accepted: [B, M] int32 draft tokens accepted per row and step; -1 where
      the row was already done (or the step never ran).
    proposed: [B] int32 draft positions proposed per row (for a token
      tree, the depths at which it had nodes).
    accepted_by_position: [G] int32, steps (over rows) in which draft
      position i was accepted.
    proposed_by_position: [G] int32, steps (over rows) in which draft
      position i (a tree: depth i + 1) was proposed.
    steps: [] int32 speculative steps run.
    target_forwards: [] int32 target passes, prefill included.
    draft_forwards: [C] int32 draft passes per drafter component
      (`Drafter.components`: a cascade's levels, a fallback's members),
      prefill included.
    scored: [B, M] int32 draft slots the step's target pass scored, per
      row and step, -1 where the row was done: G under a fixed γ (T for a
      tree); under an adaptive policy 0 (an autoregressive step) to G.
    experts: [] int32 distinct experts the verification passes of a
      mixture-of-experts target woke, summed over passes and layers (0
      for a dense target).
    expert_passes: [] int32 the passes `experts` counts.
  """

  accepted: jax.Array
  proposed: jax.Array
  accepted_by_position: jax.Array
  proposed_by_position: jax.Array
  steps: jax.Array
  target_forwards: jax.Array
  draft_forwards: jax.Array
  scored: jax.Array
  experts: jax.Array
  expert_passes: jax.Array

  @classmethod
  def zeros(cls, batch: int, gamma: int, max_steps: int,
            components: tuple[str, ...] = ("model",)) -> "SpecStats":
    zero = jnp.int32(0)
    prefill = [int(c == "model") for c in components]
    return cls(accepted=jnp.full((batch, max_steps), -1, jnp.int32),
               proposed=jnp.zeros((batch,), jnp.int32),
               accepted_by_position=jnp.zeros((gamma,), jnp.int32),
               proposed_by_position=jnp.zeros((gamma,), jnp.int32),
               steps=zero, target_forwards=jnp.int32(1),
               draft_forwards=jnp.asarray(prefill, jnp.int32),
               scored=jnp.full((batch, max_steps), -1, jnp.int32),
               experts=zero, expert_passes=zero)

  @classmethod
  def autoregressive(cls, lengths: np.ndarray, gamma: int, max_steps: int,
                     components: tuple[str, ...] = ("model",)
                     ) -> "SpecStats":
    """The counters (numpy) of a generation of `lengths` [B] tokens per
    row that took only plain steps, with no draft forward at all (not even
    its prefill): row b ran the first lengths[b] - 1 steps, each scoring
    and accepting 0 drafts."""
    lengths = np.asarray(lengths, np.int32)
    ran = np.arange(max_steps)[None] < (lengths[:, None] - 1)  # [B, M]
    per_step = np.where(ran, 0, -1).astype(np.int32)
    steps = max(int(lengths.max(initial=1)) - 1, 0)
    empty = jax.device_get(cls.zeros(len(lengths), gamma, max_steps,
                                     components))
    return empty.replace(
        accepted=per_step, scored=per_step.copy(), steps=np.int32(steps),
        target_forwards=np.int32(steps + 1),
        draft_forwards=np.zeros_like(empty.draft_forwards))

  @classmethod
  def merge(cls, stats: Sequence["SpecStats"]) -> "SpecStats":
    """Several generations' counters as one, rows concatenated (numpy).

    `accepted` is padded with -1 to the widest M; totals are summed.
    """
    width = max(np.shape(s.accepted)[1] for s in stats)
    rows = lambda name: np.concatenate([np.pad(
        np.asarray(getattr(s, name)),
        ((0, 0), (0, width - np.shape(s.accepted)[1])), constant_values=-1)
                                        for s in stats])
    total = lambda name: sum(np.asarray(getattr(s, name)) for s in stats)
    return cls(
        accepted=rows("accepted"), scored=rows("scored"),
        proposed=np.concatenate([np.asarray(s.proposed) for s in stats]),
        accepted_by_position=total("accepted_by_position"),
        proposed_by_position=total("proposed_by_position"),
        steps=total("steps"), target_forwards=total("target_forwards"),
        draft_forwards=total("draft_forwards"), experts=total("experts"),
        expert_passes=total("expert_passes"))

  def update(self, proposal: Proposal, num_accepted: jax.Array,
             active: jax.Array, scored: jax.Array | int | None = None,
             experts: jax.Array | None = None) -> "SpecStats":
    """Counts one step: `num_accepted` [B] of the proposal, for rows where
    `active` [B] (rows already done count nothing), in a target pass that
    scored `scored` ([] int32, default G) draft slots and, for a mixture
    of experts, woke `experts` ([] int32, `Verification.experts`)."""
    gamma = proposal.max_depth
    scored = gamma if scored is None else scored
    positions = jnp.arange(gamma)[None]  # [1, G] draft depth - 1
    proposed = active[:, None] & proposal.drafted_depths()
    accepted = active[:, None] & (positions < num_accepted[:, None])
    column = jnp.minimum(self.steps, self.accepted.shape[1] - 1)
    record = lambda buf, value: jax.lax.dynamic_update_slice_in_dim(
        buf, jnp.where(active, value, -1)[:, None], column, axis=1)
    return self.replace(
        accepted=record(self.accepted, num_accepted),
        scored=record(self.scored, jnp.broadcast_to(scored, active.shape)),
        proposed=self.proposed + jnp.sum(proposed, axis=1,
                                         dtype=jnp.int32),
        accepted_by_position=self.accepted_by_position
        + jnp.sum(accepted, axis=0, dtype=jnp.int32),
        proposed_by_position=self.proposed_by_position
        + jnp.sum(proposed, axis=0, dtype=jnp.int32),
        steps=self.steps + 1,
        target_forwards=self.target_forwards + 1,
        draft_forwards=self.draft_forwards + proposal.num_forwards,
        experts=self.experts + (0 if experts is None else experts),
        expert_passes=self.expert_passes + (experts is not None))

  def plain(self, ran: jax.Array, steps: jax.Array) -> "SpecStats":
    """Counts `steps` ([] int32) plain steps (no draft proposed or
    scored) at once, each `update` with nothing drafted: row b ran the
    first `ran[b]` of them (its tokens emitted), and was done for the
    rest."""
    column = jnp.arange(self.accepted.shape[1])[None]  # [1, M]
    run = (column >= self.steps) & (column < self.steps + steps)
    value = jnp.where(column < self.steps + ran[:, None], 0, -1)
    record = lambda buf: jnp.where(run, value, buf)
    return self.replace(accepted=record(self.accepted),
                        scored=record(self.scored),
                        steps=self.steps + steps,
                        target_forwards=self.target_forwards + steps)


@flax.struct.dataclass(kw_only=True)
class StepParams:
  """Traced per-call settings: changing any of them never recompiles.

  Attributes:
    sampling: temperature, top-k, top-p (applied to draft and target alike).
    eos_ids: [Y] int32 end-of-sequence ids (-1 for none).
    stop_threshold: [] float32, drafting stops when the draft's top
      probability falls below it (0 never stops).
    acceptance: the rule that judges drafts (`specjax.acceptance`; a
      `Synthetic` one reads key 0's text until `with_text`).
    stops: stop strings (`specjax.stops.StopStrings`), or None.
  """

  sampling: sampling.SamplingParams
  eos_ids: jax.Array
  stop_threshold: jax.Array
  acceptance: Acceptance = Exact()
  stops: Any = None

  @classmethod
  def create(cls, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id=None, draft_stop_threshold: float = 0.0,
             acceptance: Acceptance = Exact(),
             min_p: float | None = None, controls: Any = None,
             stops: Any = None) -> "StepParams":
    """Validates host values (see `decode.speculative_generate`)."""
    if not 0.0 <= draft_stop_threshold <= 1.0:
      raise ValueError("draft_stop_threshold must be in [0, 1], got "
                       f"{draft_stop_threshold}.")
    return cls(
        sampling=sampling.SamplingParams.create(
            temperature, top_k, top_p, min_p=min_p, controls=controls),
        eos_ids=buffers.eos_array(eos_id),
        stop_threshold=np.float32(draft_stop_threshold),
        acceptance=acceptance, stops=stops)

  def with_text(self, key: jax.Array) -> "StepParams":
    """These settings with the synthetic text of PRNG `key` (one per
    generation: the policies run with one key decode the same text); for a
    `Synthetic` acceptance only."""
    return self.replace(acceptance=self.acceptance.with_text(key))


@flax.struct.dataclass(kw_only=True)
class SpecState:
  """The speculative loop's state.

  Attributes:
    tokens: [B, W] int32 generated tokens (valid below `num_generated`).
    num_generated: [B] int32 tokens generated per row.
    done: [B] bool rows that hit EOS or N tokens.
    last_token: [B] int32 newest committed token, not yet in the target cache.
    target_cache: the target's cache (`lengths` [B] valid positions).
    drafter_state: the drafter's own state.
    key: PRNG key.
    stats: counters.
    policy_state: the γ policy's state (`specjax.policies`; None for
      `Fixed`).
    controls: the generation controls with each row's committed history
      (`specjax.controls.Controls`), or None.
    stop_state: [B] int32 the stop strings' automaton state, or None.
  """

  tokens: jax.Array
  num_generated: jax.Array
  done: jax.Array
  last_token: jax.Array
  target_cache: Any
  drafter_state: Any
  key: jax.Array
  stats: SpecStats
  policy_state: Any = None
  controls: Any = None
  stop_state: jax.Array | None = None

  @property
  def active(self) -> jax.Array:
    """[B] bool rows still generating."""
    return ~self.done


class StepPolicy(Protocol):
  """What `speculate.speculate_step` asks of a γ policy: the seam below
  `specjax.policies.GammaPolicy`, which implements it and adds a
  generation's part (`init`, `observe`, `warm`, `may_draft`).

  `state` is the policy's own pytree (`GammaPolicy.init`), carried in
  `SpecState.policy_state`.

  Attributes:
    max_gamma: G, static: the most drafts a step proposes (it fixes the
      compiled shapes).
    widths: the target pass widths T the step compiles, ascending: one
      (every step verifies all it drafted) or from 1 to G + 1
      (`verify.verify_widths`; a budget of k verifies over the smallest
      width >= k + 1).
  """

  max_gamma: int

  @property
  def widths(self) -> tuple[int, ...]:
    raise NotImplementedError

  def budget(self, state: Any, active: jax.Array,
             remaining: jax.Array | None = None) -> jax.Array:
    """[B] int32 draft budget in [0, G] for the next step (0 where
    `active` [B] is False); `remaining` [B] is the tokens each row may
    still emit, or None for no limit."""
    raise NotImplementedError

  def trim(self, state: Any, num_drafted: jax.Array, active: jax.Array,
           remaining: jax.Array | None = None) -> jax.Array:
    """[B] int32 how many of the `num_drafted` [B] drafts to verify, once
    drafted (default: all)."""
    del state, active, remaining
    return num_drafted

  def update(self, state: Any, budget: jax.Array, proposal: Proposal,
             num_accepted: jax.Array, active: jax.Array) -> Any:
    """The state after one step: `budget` [B] as chosen, the proposal,
    and `num_accepted` [B] for rows where `active` [B]."""
    raise NotImplementedError
