"""`DraftModel`: a smaller language model as the drafter.

Shape letters (`specjax.shapes`): B batch, P padded prompt, G = γ, V vocab.

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
from specjax.models.protocol import model_output


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


@flax.struct.dataclass(kw_only=True)
class _DraftLoop:
  """The drafting loop's state.

  Attributes:
    step: [] int32 drafts sampled so far (the next position to fill).
    tokens: [B, G] int32 drafts.
    q: [B, G, V] float32 the distributions they were drawn from.
    num_drafted: [B] int32 leading drafts proposed per row.
    drafting: [B] bool rows still confident enough to continue.
    cache: the draft model's cache.
  """

  step: jax.Array
  tokens: jax.Array
  q: jax.Array
  num_drafted: jax.Array
  drafting: jax.Array
  cache: Any


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
    out, cache = self.model(state.pending, state.cache)  # [B, 2, V]
    logits = model_output(out).logits
    base = start + state.num_pending
    cache = cache.rollback(base)
    last = jnp.take_along_axis(
        logits, (state.num_pending - 1)[:, None, None], axis=1)[:, 0]
    keys = jax.random.split(key, gamma)
    q0 = sampling.probabilities(last, params)  # [B, V]
    d0 = sampling.sample(keys[0], q0)  # [B]
    batch, vocab = q0.shape
    ones = jnp.ones((batch,), jnp.int32)
    loop = _DraftLoop(
        step=jnp.int32(1),
        tokens=jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(d0),
        q=jnp.zeros((batch, gamma, vocab), jnp.float32).at[:, 0].set(q0),
        num_drafted=ones, drafting=ones.astype(bool), cache=cache)

    def body(s: _DraftLoop) -> _DraftLoop:
      prev = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
      out, cache = self.model(prev, s.cache)  # [B, 1] -> [B, 1, V]
      logits = model_output(out).logits[:, 0]  # [B, V]
      qi = sampling.probabilities(logits, params)
      di = sampling.sample(keys[s.step], qi)  # [B]
      # Confidence from the raw softmax: under greedy decoding q is one-hot.
      confidence = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
      drafting = s.drafting & (confidence >= stop_threshold)
      return s.replace(
          step=s.step + 1,
          tokens=jax.lax.dynamic_update_slice_in_dim(
              s.tokens, di[:, None], s.step, 1),
          q=jax.lax.dynamic_update_slice_in_dim(s.q, qi[:, None], s.step, 1),
          num_drafted=s.num_drafted + drafting.astype(jnp.int32),
          drafting=drafting, cache=cache)

    loop = jax.lax.while_loop(
        lambda s: (s.step < gamma) & jnp.any(s.drafting), body, loop)
    proposal = Proposal(tokens=loop.tokens, q=loop.q,
                        num_drafted=loop.num_drafted, num_forwards=loop.step)
    state = state.replace(cache=loop.cache, start=start, base=base,
                          fed=loop.step - 1)
    return proposal, state

  def commit(self, state, proposal, verification, active):
    # The last accepted draft token is in the cache unless it was the final
    # drafted one (it was sampled, never fed); then it becomes pending too.
    num_accepted, emitted = verification.num_accepted, verification.emitted
    unfed = num_accepted > state.fed
    last_two = jnp.take_along_axis(  # [B, 2]: last accepted draft, next
        emitted, jnp.maximum(num_accepted - 1, 0)[:, None] + jnp.arange(2),
        axis=1)
    next_only = jnp.stack([verification.next_token,
                           jnp.zeros_like(verification.next_token)], axis=1)
    pending = jnp.where(unfed[:, None], last_two, next_only)
    lengths = state.base + jnp.minimum(num_accepted, state.fed)
    return state.replace(
        cache=state.cache.rollback(jnp.where(active, lengths, state.start)),
        pending=jnp.where(active[:, None], pending, state.pending),
        num_pending=jnp.where(active, 1 + unfed.astype(jnp.int32),
                              state.num_pending))
