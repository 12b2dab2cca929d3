"""`Cascade`: a draft model that drafts its block by speculative decoding.

Shape letters (`specjax.shapes`): B batch, G = γ (the block the cascade
proposes), V vocab; γ' is the inner drafter's own γ.

`Cascade(model, drafter, gamma)` is staged speculation: `drafter` (prompt
lookup, a smaller model, or another cascade) proposes γ' tokens to
`model`, which verifies them with `specjax.verify.verify` and rejection
sampling, round after round, until every row holds a block of G tokens.
Speculative sampling makes the block distributed exactly as `model`'s own
autoregressive samples, and the q of each block token is `model`'s
probability at that position (from its verification passes), so the
target's rejection sampler above stays exact. Levels nest:
`Cascade(m1, Cascade(m2, PromptLookup(V), 2), 4)`.

After the target's verdict, `model` keeps the accepted part of the block
cached (`track.rewind`), and the inner drafter is told the committed text
from its state before the block (it catches up on it at the next step).
Forwards are counted per level (`components`).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import cache as cache_lib
from specjax.drafters import track
from specjax.drafters.base import capped
from specjax.drafters.base import Drafter
from specjax.drafters.base import forwards
from specjax.drafters.base import where_rows
from specjax.models.protocol import LanguageModel
from specjax.step_types import Proposal
from specjax.verify import verify


@flax.struct.dataclass(kw_only=True)
class CascadeState:
  """The middle model's track and the inner drafter's state.

  Attributes:
    track: `model`'s cache and the text it follows.
    inner: the inner drafter's state as of the last commit.
  """

  track: track.Track
  inner: Any


@flax.struct.dataclass(kw_only=True)
class _Rounds:
  """The rounds loop's state.

  Attributes:
    count: [B] int32 block tokens so far.
    block: [B, G + γ' + 1] int32 the block (a round may overshoot G).
    q: [B, G + γ' + 1, V] float32 `model`'s probabilities for each.
    cache: `model`'s cache.
    last_token: [B] int32 newest block (or committed) token, not cached.
    inner: the inner drafter's state.
    key: PRNG key.
    model_forwards: [] int32 `model` passes.
    inner_forwards: [components of the inner drafter] int32.
  """

  count: jax.Array
  block: jax.Array
  q: jax.Array
  cache: Any
  last_token: jax.Array
  inner: Any
  key: jax.Array
  model_forwards: jax.Array
  inner_forwards: jax.Array


@flax.struct.dataclass
class Cascade(Drafter):
  """Drafts G tokens of `model` by speculative decoding with `drafter`
  proposing `gamma` (γ') tokens per round."""

  model: LanguageModel
  drafter: Drafter
  gamma: int = flax.struct.field(pytree_node=False, default=4)

  def __post_init__(self):
    if self.drafter.vocab_size not in (None, self.model.vocab_size):
      raise ValueError(
          f"Cascade levels' vocabularies differ: the model has "
          f"{self.model.vocab_size} tokens, its drafter "
          f"{self.drafter.vocab_size}.")
    if isinstance(self.gamma, bool) or int(self.gamma) != self.gamma or (
        self.gamma < 1):
      raise ValueError(f"Cascade gamma must be an integer >= 1, got "
                       f"{self.gamma!r}.")

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def for_target(self, target, tokenizer=None) -> "Cascade":
    """Its drafter filled in from its own model, which it drafts for."""
    del target
    return self.replace(drafter=self.drafter.for_target(self.model,
                                                        tokenizer))

  @property
  def components(self) -> tuple[str, ...]:
    return ("model",) + self.drafter.components

  @property
  def commits_text(self) -> bool:
    return self.drafter.commits_text

  @property
  def extra_positions(self) -> int:
    """Cache positions needed past the engine's γ+1: a round may overshoot
    the block by γ', and the inner drafter may need its own."""
    return self.gamma + 1 + self.drafter.extra_positions

  @property
  def cost_model(self) -> LanguageModel:
    return self.model

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    return CascadeState(
        track=track.init(self.model, prompts, prompt_lengths, first_token,
                         cache_size),
        inner=self.drafter.init(prompts, prompt_lengths, first_token,
                                cache_size))

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    # Feed the committed text but its last token, which opens round one.
    _, tr, passes = track.catch_up(self.model, state.track, width=gamma + 1,
                                   keep=1)
    last_token = jnp.take_along_axis(
        tr.context, (tr.length - 1)[:, None], axis=1)[:, 0]
    batch, width = last_token.shape[0], gamma + self.gamma + 1
    inner_parts = len(self.drafter.components)
    # [B] tokens each row drafts: a block of gamma, or its limit.
    cap = capped(jnp.full((batch,), gamma, jnp.int32), limit)
    rounds = _Rounds(
        count=jnp.zeros((batch,), jnp.int32),
        block=jnp.zeros((batch, width), jnp.int32),
        q=jnp.zeros((batch, width, self.vocab_size), jnp.float32),
        cache=tr.cache, last_token=last_token, inner=state.inner, key=key,
        model_forwards=passes,
        inner_forwards=jnp.zeros((inner_parts,), jnp.int32))

    def body(r: _Rounds) -> _Rounds:
      need = r.count < cap  # [B] rows still short of a block
      key, draft_key, verify_key = jax.random.split(r.key, 3)
      proposal, inner = self.drafter.propose(r.inner, draft_key, params,
                                             self.gamma, stop_threshold)
      start = r.cache.lengths
      verdict, cache = verify(self.model, r.cache, r.last_token, proposal,
                              params, verify_key)
      inner = self.drafter.commit(inner, proposal, verdict, need)
      write = lambda buf, new: where_rows(
          need, cache_lib.write_rows(buf, new, r.count), buf)
      return _Rounds(
          count=jnp.where(need, r.count + verdict.num_emitted, r.count),
          block=write(r.block, verdict.emitted),
          q=write(r.q, verdict.probs),
          cache=cache.rollback(jnp.where(need, cache.lengths, start)),
          last_token=jnp.where(need, verdict.next_token, r.last_token),
          inner=inner, key=key, model_forwards=r.model_forwards + 1,
          inner_forwards=r.inner_forwards + forwards(proposal,
                                                     self.drafter))

    rounds = jax.lax.while_loop(lambda r: jnp.any(r.count < cap), body,
                                rounds)
    proposal = Proposal(
        tokens=rounds.block[:, :gamma], q=rounds.q[:, :gamma],
        num_drafted=cap,
        num_forwards=jnp.concatenate([rounds.model_forwards[None],
                                      rounds.inner_forwards]))
    # The cache holds the block but its last token; record it as scratch.
    tr = track.write_scratch(tr.replace(cache=rounds.cache), rounds.block)
    return proposal, state.replace(track=tr)

  def commit(self, state, proposal, verification, active):
    # The inner drafter's state predates the block: it learns the
    # committed text as if it had sat the step out.
    return CascadeState(
        track=track.rewind(state.track, verification.emitted,
                           verification.num_emitted, active),
        inner=self.drafter.commit(state.inner, proposal, verification,
                                  active))
