"""`DraftModel`: a smaller language model as the drafter.

Shape letters (`specjax.shapes`): B batch, P padded prompt, G = γ, V vocab.

Each step first feeds the committed tokens the draft has not seen
(`track.catch_up`: usually one, or two when the previous step accepted the
whole block and the last draft was never fed, or a block of any length
after steps in which another drafter proposed, in chunks of γ+1 tokens),
then drafts autoregressively in a `lax.while_loop`. A row stops drafting
once the draft's top probability (raw softmax, before sampling processing)
falls below the threshold, and the loop ends when no row is still
drafting; the padding stays static. `commit` keeps the drafted positions
the target accepted (`track.rewind`), whoever proposed them.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.drafters import track
from specjax.drafters.base import Proposal
from specjax.models.protocol import model_output


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

  components = ("model",)

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    return track.init(self.model, prompts, prompt_lengths, first_token,
                      cache_size)

  def propose(self, state, key, params, gamma, stop_threshold):
    last, state, passes = track.catch_up(self.model, state, width=gamma + 1)
    keys = jax.random.split(key, gamma)
    q0 = sampling.probabilities(last, params)  # [B, V]
    d0 = sampling.sample(keys[0], q0)  # [B]
    batch, vocab = q0.shape
    ones = jnp.ones((batch,), jnp.int32)
    loop = _DraftLoop(
        step=jnp.int32(1),
        tokens=jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(d0),
        q=jnp.zeros((batch, gamma, vocab), jnp.float32).at[:, 0].set(q0),
        num_drafted=ones, drafting=ones.astype(bool), cache=state.cache)

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
                        num_drafted=loop.num_drafted,
                        num_forwards=passes + loop.step - 1)
    state = track.write_scratch(state.replace(cache=loop.cache), loop.tokens)
    return proposal, state

  def commit(self, state, proposal, verification, active):
    del proposal
    return track.rewind(state, verification.emitted,
                        verification.num_emitted, active)
