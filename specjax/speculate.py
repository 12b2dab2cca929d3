"""One speculative step: draft, verify in one padded pass, rejection-sample.

Shape letters: B batch, G = γ draft tokens per step, V vocab, N max new
tokens, M = max(N - 1, 1) most steps a generation can take (every step emits at
least one token and the first comes from prefill), W = N + G + 1.

`speculate_step` is a pure function of `SpecState`; `decode` runs it in a
`lax.while_loop`. The target scores the last committed token and the G draft
tokens in a single static-shape pass at each row's own cache offset. Rows
accept different counts; each row's target and draft caches roll back to their
own lengths. Rows that are done are carried along unchanged.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import buffers
from specjax import rejection
from specjax import sampling
from specjax.drafters.base import Drafter


@flax.struct.dataclass(kw_only=True)
class SpecStats:
  """Counters accumulated over a generation.

  Attributes:
    accepted: [B, M] int32 draft tokens accepted per row and step; -1 where
      the row was already done (or the step never ran).
    proposed: [B] int32 draft tokens proposed per row.
    accepted_by_position: [G] int32, steps (over rows) in which draft
      position i was accepted.
    proposed_by_position: [G] int32, steps (over rows) in which draft
      position i was proposed.
    steps: [] int32 speculative steps run.
    target_forwards: [] int32 target passes, prefill included.
    draft_forwards: [] int32 draft passes, prefill included.
  """

  accepted: jax.Array
  proposed: jax.Array
  accepted_by_position: jax.Array
  proposed_by_position: jax.Array
  steps: jax.Array
  target_forwards: jax.Array
  draft_forwards: jax.Array

  @classmethod
  def zeros(cls, batch: int, gamma: int, max_steps: int) -> "SpecStats":
    zero = jnp.int32(0)
    return cls(accepted=jnp.full((batch, max_steps), -1, jnp.int32),
               proposed=jnp.zeros((batch,), jnp.int32),
               accepted_by_position=jnp.zeros((gamma,), jnp.int32),
               proposed_by_position=jnp.zeros((gamma,), jnp.int32),
               steps=zero, target_forwards=jnp.int32(1),
               draft_forwards=jnp.int32(1))


@flax.struct.dataclass(kw_only=True)
class StepParams:
  """Traced per-call settings: changing any of them never recompiles.

  Attributes:
    sampling: temperature, top-k, top-p (applied to draft and target alike).
    eos_ids: [E] int32 end-of-sequence ids (-1 for none).
    stop_threshold: [] float32, drafting stops when the draft's top
      probability falls below it (0 never stops).
    synthetic_rate: [] float32 acceptance probability used only by synthetic
      verification.
  """

  sampling: sampling.SamplingParams
  eos_ids: jax.Array
  stop_threshold: jax.Array
  synthetic_rate: jax.Array

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
        synthetic_rate=jnp.float32(rate))


@flax.struct.dataclass(kw_only=True)
class SpecState:
  """The speculative loop's state.

  Attributes:
    tokens: [B, W] int32 generated tokens (valid below `lengths`).
    lengths: [B] int32 tokens generated per row.
    done: [B] bool rows that hit EOS or N tokens.
    last_token: [B] int32 newest committed token, not yet in the target cache.
    target_cache: the target's cache (`lengths` [B] valid positions).
    drafter_state: the drafter's own state.
    key: PRNG key.
    stats: counters.
  """

  tokens: jax.Array
  lengths: jax.Array
  done: jax.Array
  last_token: jax.Array
  target_cache: Any
  drafter_state: Any
  key: jax.Array
  stats: SpecStats

  @property
  def active(self) -> jax.Array:
    """[B] bool rows still generating."""
    return ~self.done


def speculate_step(state: SpecState, *, target: Any, drafter: Drafter,
                   params: StepParams, gamma: int,
                   max_new_tokens: int | jax.Array,
                   synthetic: bool = False) -> SpecState:
  """Drafts γ tokens, verifies them in one target pass, and commits.

  Args:
    state: loop state.
    target: a `specjax.models.LanguageModel`.
    drafter: a `specjax.drafters.Drafter`.
    params: traced settings.
    gamma: G, static.
    max_new_tokens: N, an int or a traced [] int32.
    synthetic: accept with `params.synthetic_rate` instead of p/q (for system
      benchmarks on random weights; not distribution-preserving).

  Returns:
    The next state.
  """
  key, draft_key, verify_key = jax.random.split(state.key, 3)
  proposal, drafter_state = drafter.propose(
      state.drafter_state, draft_key, params.sampling, gamma,
      params.stop_threshold)

  # Verify: the last committed token and the G drafts, [B, G+1].
  chunk = jnp.concatenate([state.last_token[:, None], proposal.tokens], 1)
  start = state.target_cache.lengths
  logits, target_cache = target(chunk, state.target_cache)  # [B, G+1, V]
  p = sampling.probabilities(logits, params.sampling)  # [B, G+1, V]
  if synthetic:
    num_accepted, next_token = rejection.synthetic_sample(
        verify_key, params.synthetic_rate, proposal.tokens, p,
        proposal.num_drafted)
  else:
    num_accepted, next_token = rejection.rejection_sample(
        verify_key, proposal.tokens, proposal.q, p, proposal.num_drafted)

  active = state.active
  num_accepted = jnp.where(active, num_accepted, 0)
  target_cache = target_cache.rollback(
      jnp.where(active, start + 1 + num_accepted, start))
  drafter_state = drafter.commit(drafter_state, proposal, num_accepted,
                                 next_token, active)

  # Emitted this step: accepted drafts then the next token, [B, G+1].
  slots = jnp.arange(gamma + 1)[None]
  padded = jnp.concatenate([proposal.tokens, next_token[:, None]], axis=1)
  emitted = jnp.where(slots < num_accepted[:, None], padded,
                      next_token[:, None])
  tokens, lengths, done = buffers.emit(
      state.tokens, state.lengths, state.done, emitted, num_accepted + 1,
      params.eos_ids, max_new_tokens)

  stats = state.stats
  positions = jnp.arange(gamma)[None]  # [1, G]
  proposed = active[:, None] & (positions < proposal.num_drafted[:, None])
  accepted = active[:, None] & (positions < num_accepted[:, None])
  step_col = jnp.where(active, num_accepted, -1)[:, None]
  stats = stats.replace(
      accepted=jax.lax.dynamic_update_slice_in_dim(
          stats.accepted, step_col, jnp.minimum(
              stats.steps, stats.accepted.shape[1] - 1), axis=1),
      proposed=stats.proposed + jnp.sum(proposed, axis=1, dtype=jnp.int32),
      accepted_by_position=stats.accepted_by_position
      + jnp.sum(accepted, axis=0, dtype=jnp.int32),
      proposed_by_position=stats.proposed_by_position
      + jnp.sum(proposed, axis=0, dtype=jnp.int32),
      steps=stats.steps + 1,
      target_forwards=stats.target_forwards + 1,
      draft_forwards=stats.draft_forwards + proposal.num_forwards)

  return state.replace(
      tokens=tokens, lengths=lengths, done=done,
      last_token=jnp.where(active, next_token, state.last_token),
      target_cache=target_cache, drafter_state=drafter_state, key=key,
      stats=stats)
