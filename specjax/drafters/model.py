"""`DraftModel`: a smaller language model as the drafter.

Shape letters: B batch, P padded prompt, G = γ, V vocab.

Each step feeds the tokens the draft has not seen yet (one, or two when the
previous step accepted the whole block and the draft never consumed its last
token), then drafts autoregressively in a `lax.while_loop`. A row stops
drafting once the draft's top probability (raw softmax, before sampling
processing) falls below the threshold, and the loop ends when no row is still
drafting; the padding stays static. Rollback sets the cache's per-row lengths.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.drafters.base import Proposal


@flax.struct.dataclass(kw_only=True)
class DraftModelState:
  """What the draft model carries between steps.

  Attributes:
    cache: the draft model's cache; `cache.lengths` [B] counts consumed
      tokens.
    pending: [B, 2] int32 committed tokens not yet fed to the draft.
    num_pending: [B] int32 in {1, 2}, how many of `pending` are real.
    start: [B] int32 cache lengths when the last proposal began.
    base: [B] int32 cache lengths after the pending tokens were fed.
    fed: [] int32 draft tokens of the last proposal written after `base`.
  """

  cache: Any
  pending: jax.Array
  num_pending: jax.Array
  start: jax.Array
  base: jax.Array
  fed: jax.Array


@flax.struct.dataclass
class DraftModel:
  """Drafts with a `specjax.models.LanguageModel` (e.g. a small `Model`)."""

  model: Any

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    batch = prompts.shape[0]
    cache = self.model.init_cache(batch, cache_size)
    _, cache = self.model.prefill(prompts, prompt_lengths, cache)
    pending = jnp.stack([first_token, jnp.zeros_like(first_token)], axis=1)
    return DraftModelState(
        cache=cache, pending=pending.astype(jnp.int32),
        num_pending=jnp.ones((batch,), jnp.int32), start=cache.lengths,
        base=cache.lengths, fed=jnp.int32(0))

  def propose(self, state, key, params, gamma, stop_threshold):
    start = state.cache.lengths
    logits, cache = self.model(state.pending, state.cache)  # [B, 2, V]
    base = start + state.num_pending
    cache = cache.rollback(base)
    last = jnp.take_along_axis(
        logits, (state.num_pending - 1)[:, None, None], axis=1)[:, 0]
    keys = jax.random.split(key, gamma)
    q0 = sampling.probabilities(last, params)  # [B, V]
    d0 = sampling.sample(keys[0], q0)  # [B]
    batch, vocab = q0.shape
    tokens = jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(d0)
    q = jnp.zeros((batch, gamma, vocab), jnp.float32).at[:, 0].set(q0)

    def cond(carry):
      i, _, _, _, drafting, _ = carry
      return (i < gamma) & jnp.any(drafting)

    def body(carry):
      i, tokens, q, num_drafted, drafting, cache = carry
      prev = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)  # [B, 1]
      logits, cache = self.model(prev, cache)
      qi = sampling.probabilities(logits[:, 0], params)  # [B, V]
      di = sampling.sample(keys[i], qi)
      # Confidence from the raw softmax: under greedy decoding q is one-hot.
      confidence = jnp.max(jax.nn.softmax(logits[:, 0], axis=-1), axis=-1)
      drafting &= confidence >= stop_threshold
      num_drafted += drafting.astype(jnp.int32)
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, di[:, None], i, 1)
      q = jax.lax.dynamic_update_slice_in_dim(q, qi[:, None], i, 1)
      return i + 1, tokens, q, num_drafted, drafting, cache

    ones = jnp.ones((batch,), jnp.int32)
    init = (jnp.int32(1), tokens, q, ones, ones.astype(bool), cache)
    steps, tokens, q, num_drafted, _, cache = jax.lax.while_loop(
        cond, body, init)
    proposal = Proposal(tokens=tokens, q=q, num_drafted=num_drafted,
                        num_forwards=steps)
    state = state.replace(cache=cache, start=start, base=base, fed=steps - 1)
    return proposal, state

  def commit(self, state, proposal, num_accepted, next_token, active):
    # The last accepted draft token is in the cache unless it was the final
    # drafted one (it was sampled, never fed); then it becomes pending too.
    unfed = num_accepted > state.fed
    last_draft = jnp.take_along_axis(
        proposal.tokens, jnp.maximum(num_accepted - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(unfed[:, None],
                        jnp.stack([last_draft, next_token], axis=1),
                        jnp.stack([next_token, jnp.zeros_like(next_token)], 1))
    lengths = state.base + jnp.minimum(num_accepted, state.fed)
    return state.replace(
        cache=state.cache.rollback(jnp.where(active, lengths, state.start)),
        pending=jnp.where(active[:, None], pending, state.pending),
        num_pending=jnp.where(active, 1 + unfed.astype(jnp.int32),
                              state.num_pending))
