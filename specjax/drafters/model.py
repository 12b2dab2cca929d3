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
from specjax.drafters.base import Drafter
from specjax.drafters.base import pad_nodes
from specjax.step_types import Proposal
from specjax.models.protocol import LanguageModel
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
    params: the sampling settings with the controls' history through the
      drafts so far (`specjax.controls`).
  """

  step: jax.Array
  tokens: jax.Array
  q: jax.Array
  num_drafted: jax.Array
  drafting: jax.Array
  cache: Any
  params: sampling.SamplingParams


@flax.struct.dataclass
class DraftModel(Drafter):
  """Drafts with a `specjax.models.LanguageModel` (e.g. a small `Model`)."""

  model: LanguageModel

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  components = ("model",)
  supports_trees = True
  # A `limit` of zeros runs no model: the caches only flow through while
  # loops that take no trip (`base.propose_if`).
  gates_itself = True
  commits_text = True

  @property
  def cost_model(self) -> LanguageModel:
    return self.model

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    return track.init(self.model, prompts, prompt_lengths, first_token,
                      cache_size)

  def init_guess(self, prompts, prompt_lengths, first_token, cache_size):
    """`init`, and the draft's logits [B, V] after the prompt: the
    distribution it would have drafted `first_token` from, which its
    prefill computes anyway."""
    return track.init(self.model, prompts, prompt_lengths, first_token,
                      cache_size, return_logits=True)

  def propose(self, state, key, params, gamma, stop_threshold, limit=None,
              num_nodes=None):
    if num_nodes is not None:
      return self._tree(state, gamma, num_nodes)
    batch, vocab = state.context.shape[0], self.vocab_size
    cap = jnp.full((batch,), gamma, jnp.int32) if limit is None else limit
    drafts = jnp.any(cap > 0)
    last, state, passes = track.catch_up(self.model, state, width=gamma + 1,
                                         when=drafts)
    keys = jax.random.split(key, gamma)

    def sample_first(logits):  # [B, V] -> q [B, V], draft [B]
      q = sampling.probabilities(logits, params)
      return q, sampling.sample(keys[0], q)

    q0, d0 = jax.lax.cond(
        drafts, sample_first,
        lambda x: (jnp.zeros_like(x), jnp.zeros((batch,), jnp.int32)), last)
    first = jnp.minimum(cap, 1)  # [B] 0 for a row that drafts nothing
    loop = _DraftLoop(
        step=jnp.int32(1),
        tokens=jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(d0),
        q=jnp.zeros((batch, gamma, vocab), jnp.float32).at[:, 0].set(q0),
        num_drafted=first, drafting=cap > 1, cache=state.cache,
        params=params.advance(d0))

    def body(s: _DraftLoop) -> _DraftLoop:
      prev = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
      out, cache = self.model(prev, s.cache)  # [B, 1] -> [B, 1, V]
      logits = model_output(out).logits[:, 0]  # [B, V]
      qi = sampling.probabilities(logits, s.params)
      di = sampling.sample(keys[s.step], qi)  # [B]
      # Confidence from the raw softmax: under greedy decoding q is one-hot.
      confidence = sampling.top_probability(logits)
      drafting = s.drafting & (confidence >= stop_threshold)
      added = drafting.astype(jnp.int32)
      drafting &= s.step + 1 < cap
      return s.replace(
          step=s.step + 1,
          tokens=jax.lax.dynamic_update_slice_in_dim(
              s.tokens, di[:, None], s.step, 1),
          q=jax.lax.dynamic_update_slice_in_dim(s.q, qi[:, None], s.step, 1),
          num_drafted=s.num_drafted + added,
          drafting=drafting, cache=cache, params=s.params.advance(di))

    loop = jax.lax.while_loop(
        lambda s: (s.step < gamma) & jnp.any(s.drafting), body, loop)
    proposal = Proposal(tokens=loop.tokens, q=loop.q,
                        num_drafted=loop.num_drafted,
                        num_forwards=passes + loop.step - 1)
    state = track.write_scratch(state.replace(cache=loop.cache), loop.tokens)
    return proposal, state

  def _tree(self, state, gamma, num_nodes):
    """A tree of `width` = num_nodes // γ nodes per depth, grown by draft
    confidence (EAGLE-2's selection under a static budget, Li et al.
    2024): at each depth, the top `width` children of every frontier node
    are scored by the draft's log-probability of their whole path, and the
    `width` best become the next frontier. Children are chosen
    deterministically (q=None), which keeps verification exact
    (`specjax.tree`). One draft pass per depth scores the frontier, its
    nodes reading the committed cache and their own ancestors, which sit in
    the cache past the committed text (node j at slot `base + j`,
    `cache_mask`); the cache is rolled back to the committed text
    afterwards, and `commit` moves the accepted path's slots into place
    (`track.keep_path`) instead of feeding it again.
    """
    width = num_nodes // gamma
    logits, state, passes = track.catch_up(self.model, state,
                                           width=gamma + 1)
    base = state.cache.lengths  # [B] committed tokens, all cached
    batch, size = base.shape[0], width * gamma
    slots = jnp.arange(state.cache.size)[None, None]  # [1, 1, S]
    # Depth 1: the root's `width` most likely children.
    score, tokens = jax.lax.top_k(jax.nn.log_softmax(logits), width)
    nodes = dict(tokens=jnp.zeros((batch, size), jnp.int32).at[:, :width]
                 .set(tokens),
                 parents=jnp.full((batch, size), -1, jnp.int32))
    # ancestors[b, i, j]: node j is an ancestor of node i.
    ancestors = jnp.zeros((batch, size, size), bool)
    cache = state.cache
    for level in range(1, gamma):
      lo = (level - 1) * width  # the frontier: nodes lo .. lo + width - 1
      frontier = jnp.arange(lo, lo + width)
      # Node j's keys sit at slot base + j once its depth was scored.
      seen = (slots < base[:, None, None]) | jnp.take_along_axis(
          jnp.pad(ancestors[:, lo:lo + width],
                  ((0, 0), (0, 0), (0, cache.size - size))),
          jnp.broadcast_to(slots - base[:, None, None],
                           (batch, width, cache.size)).clip(0), axis=2)
      cache = cache.rollback(base + lo)
      out, cache = self.model(
          jax.lax.dynamic_slice_in_dim(nodes["tokens"], lo, width, axis=1),
          cache, positions=jnp.broadcast_to(base[:, None] - 1 + level,
                                            (batch, width)),
          mask=jnp.eye(width, dtype=bool)[None], cache_mask=seen)
      logq = jax.nn.log_softmax(model_output(out).logits)  # [B, W, V]
      child_score, child = jax.lax.top_k(logq, width)  # [B, W, W]
      total = (score[:, :, None] + child_score).reshape(batch, -1)
      score, pick = jax.lax.top_k(total, width)  # [B, W]
      parent = frontier[pick // width]  # [B, W]
      token = jnp.take_along_axis(child.reshape(batch, -1), pick, axis=1)
      new = jnp.arange(lo + width, lo + 2 * width)
      nodes["tokens"] = nodes["tokens"].at[:, new].set(token)
      nodes["parents"] = nodes["parents"].at[:, new].set(parent)
      above = jnp.take_along_axis(ancestors, parent[:, :, None], axis=1)
      above |= jax.nn.one_hot(parent, size, dtype=bool)
      ancestors = ancestors.at[:, new].set(above)
    depth = jnp.repeat(jnp.arange(1, gamma + 1), width)[None]
    filled = pad_nodes(dict(
        nodes, depth=jnp.broadcast_to(depth, (batch, size)),
        valid=jnp.ones((batch, size), bool),
        num_drafted=jnp.full((batch,), size, jnp.int32)), num_nodes)
    proposal = Proposal(q=None, num_forwards=passes + gamma - 1,
                        tree_depth=gamma, **filled)
    return proposal, state.replace(cache=cache.rollback(base))

  def commit(self, state, proposal, verification, active):
    base = state.length
    state = track.rewind(state, verification.emitted,
                         verification.num_emitted, active)
    if verification.path is None or proposal.tree_depth < 2:
      return state
    # `_tree` fed every node above the deepest level: the accepted path's
    # first min(accepted, γ - 1) nodes are in the cache past `base`.
    return track.keep_path(
        state, base, jnp.maximum(verification.path - 1, 0),
        jnp.minimum(verification.num_accepted, proposal.tree_depth - 1),
        active)
