"""One speculative step: draft, verify, commit, count.

Shape letters (`specjax.shapes`): B batch, G = γ draft tokens per step, V
vocab, Y end-of-sequence ids, N max new tokens, M = max(N_cap - 1, 1) most
steps a generation can take (every step emits at least one token and the
first comes from prefill), W = N_cap + G + 1.

`speculate_step` is a pure function of `SpecState`; `decode` runs it in a
`lax.while_loop`. It is four stages, each reusable on its own: the drafter
proposes (`Drafter.propose`), the target scores the last committed token and
the G drafts in one static-shape pass and rejection-samples them
(`specjax.verify.verify`), the drafter and the output buffer commit what was
emitted (`Drafter.commit`, `buffers.emit`), and `SpecStats.update` counts.
Rows accept different counts; each row's target and draft caches roll back to
their own lengths. Rows that are done are carried along unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import buffers
from specjax import rejection
from specjax import sampling
from specjax.adaptive import GammaPolicy
from specjax.drafters.base import capped
from specjax.drafters.base import Drafter
from specjax.drafters.base import Proposal
from specjax.drafters.base import propose_if
from specjax.verify import verify
from specjax.verify import verify_within


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
      row and step, -1 where the row was done: G under a fixed γ; under an
      adaptive policy 0 (an autoregressive step) to G.
  """

  accepted: jax.Array
  proposed: jax.Array
  accepted_by_position: jax.Array
  proposed_by_position: jax.Array
  steps: jax.Array
  target_forwards: jax.Array
  draft_forwards: jax.Array
  scored: jax.Array

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
               scored=jnp.full((batch, max_steps), -1, jnp.int32))

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
        draft_forwards=total("draft_forwards"))

  def update(self, proposal: Proposal, num_accepted: jax.Array,
             active: jax.Array, scored: jax.Array | int | None = None
             ) -> "SpecStats":
    """Counts one step: `num_accepted` [B] of the proposal, for rows where
    `active` [B] (rows already done count nothing), in a target pass that
    scored `scored` ([] int32, default G) draft slots."""
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
        draft_forwards=self.draft_forwards + proposal.num_forwards)


@flax.struct.dataclass(kw_only=True)
class StepParams:
  """Traced per-call settings: changing any of them never recompiles.

  Attributes:
    sampling: temperature, top-k, top-p (applied to draft and target alike).
    eos_ids: [Y] int32 end-of-sequence ids (-1 for none).
    stop_threshold: [] float32, drafting stops when the draft's top
      probability falls below it (0 never stops).
    synthetic: the rate and text of synthetic verification
      (`rejection.Synthetic`), used only when a step is told to; the text
      is key 0's until `with_text`.
  """

  sampling: sampling.SamplingParams
  eos_ids: jax.Array
  stop_threshold: jax.Array
  synthetic: rejection.Synthetic

  @classmethod
  def create(cls, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id=None, draft_stop_threshold: float = 0.0,
             synthetic_acceptance: float | None = None) -> "StepParams":
    """Validates host values (see `decode.speculative_generate`)."""
    rate = 0.0 if synthetic_acceptance is None else float(synthetic_acceptance)
    if not 0.0 <= rate <= 1.0:
      raise ValueError("synthetic_acceptance must be in [0, 1], got "
                       f"{synthetic_acceptance}.")
    if not 0.0 <= draft_stop_threshold <= 1.0:
      raise ValueError("draft_stop_threshold must be in [0, 1], got "
                       f"{draft_stop_threshold}.")
    return cls(
        sampling=sampling.SamplingParams.create(temperature, top_k, top_p),
        eos_ids=buffers.eos_array(eos_id),
        stop_threshold=jnp.float32(draft_stop_threshold),
        synthetic=rejection.Synthetic(rate=jnp.float32(rate),
                                      text=jax.random.key(0)))

  def with_text(self, key: jax.Array) -> "StepParams":
    """These settings with the synthetic text of PRNG `key` (one per
    generation: the policies run with one key decode the same text)."""
    return self.replace(synthetic=self.synthetic.replace(text=key))


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
    policy_state: an adaptive γ policy's state (`specjax.adaptive`), or
      None under a fixed γ.
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

  @property
  def active(self) -> jax.Array:
    """[B] bool rows still generating."""
    return ~self.done


def speculate_step(state: SpecState, *, target: Any, drafter: Drafter,
                   params: StepParams, gamma: int,
                   max_new_tokens: int | jax.Array,
                   synthetic: bool = False,
                   policy: GammaPolicy | None = None,
                   num_nodes: int | None = None) -> SpecState:
  """Drafts up to γ tokens, verifies them in one target pass, and commits.

  Args:
    state: loop state.
    target: a `specjax.models.LanguageModel`.
    drafter: a `specjax.drafters.Drafter`.
    params: traced settings.
    gamma: G, static (γ_max under a policy).
    max_new_tokens: N, an int or a traced [] int32.
    synthetic: accept by `params.synthetic` instead of p/q (for system
      benchmarks on random weights; not distribution-preserving).
    policy: None for a fixed γ = G; else an adaptive policy
      (`specjax.adaptive`) that sets each step's draft budget, drafting
      only when some row's budget is positive and verifying over the
      smallest compiled width that holds the proposal.
    num_nodes: None for a chain of G drafts; T for a token tree of at most
      T nodes at depth at most G (`specjax.tree`), verified in one pass of
      T + 1 tokens.

  Returns:
    The next state.
  """
  key, draft_key, verify_key = jax.random.split(state.key, 3)
  active = state.active
  verdicts = params.synthetic if synthetic else None
  tree_kw = {} if num_nodes is None else {"num_nodes": num_nodes}
  propose = lambda s, **kw: drafter.propose(
      s, draft_key, params.sampling, gamma, params.stop_threshold,
      **tree_kw, **kw)
  start = state.target_cache.lengths
  if policy is None:
    proposal, drafter_state = propose(state.drafter_state)
    verification, target_cache = verify(
        target, state.target_cache, state.last_token, proposal,
        params.sampling, verify_key, synthetic=verdicts)
    scored = num_nodes or gamma
  else:
    remaining = max_new_tokens - state.num_generated  # [B]
    budget = policy.budget(state.policy_state, active, remaining)  # [B]

    def draft(s):
      proposal, s = propose(s, limit=budget)
      return proposal.replace(
          num_drafted=capped(proposal.num_drafted, budget)), s

    proposal, drafter_state = propose_if(jnp.any(budget > 0), draft,
                                         state.drafter_state, drafter)
    proposal = proposal.replace(num_drafted=capped(
        proposal.num_drafted,
        policy.trim(state.policy_state, proposal.num_drafted, active,
                    remaining)))
    verification, target_cache, scored = verify_within(
        policy.widths, target, state.target_cache, state.last_token,
        proposal, params.sampling, verify_key, synthetic=verdicts)

  num_accepted = jnp.where(active, verification.num_accepted, 0)
  verification = verification.replace(num_accepted=num_accepted)
  target_cache = target_cache.rollback(
      jnp.where(active, target_cache.lengths, start))
  drafter_state = drafter.commit(drafter_state, proposal, verification,
                                 active)
  tokens, num_generated, done = buffers.emit(
      state.tokens, state.num_generated, state.done, verification.emitted,
      verification.num_emitted, params.eos_ids, max_new_tokens)
  policy_state = state.policy_state
  if policy is not None:
    policy_state = policy.update(policy_state, budget, proposal,
                                 num_accepted, active)
  return state.replace(
      tokens=tokens, num_generated=num_generated, done=done,
      last_token=jnp.where(active, verification.next_token,
                           state.last_token),
      target_cache=target_cache, drafter_state=drafter_state, key=key,
      stats=state.stats.update(proposal, num_accepted, active, scored),
      policy_state=policy_state)
