"""EAGLE (Li et al. 2024): a one-layer drafter over the target's features.

Shape letters (`specjax.shapes`): B batch, P padded prompt, T chunk, G = γ,
V vocab, E hidden, S cache size.

EAGLE drafts at the feature level. Position i of its input is the pair
(f_i, e(t_{i+1})): the target's last hidden state at position i (the LM
head's input, whose output is the law of token i+1) and the embedding of
the token that followed. A linear map [2E -> E] and one decoder layer of
the target's shape (`specjax.models.block.Block`, its own small KV
cache) predict f_{i+1}; the target's frozen LM head turns that into the
law of token i+2. Drafting is autoregressive (EAGLE-1's chain, in a
`lax.while_loop`): each drafted token and the predicted feature are the
next input pair.

As a `Drafter`, `Eagle` keeps its cache in step with the committed text
using the target's own features: `init` reads the prompt's from the
target's prefill (`uses_prompt_hidden`), and `commit` feeds the accepted
positions' features from the verification pass, so only drafted pairs use
predicted features, and they are rolled back. Each draft is sampled from
the distribution it reports as q, so the output is exactly the target's.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from specjax import cache as cache_lib
from specjax import sampling
from specjax.drafters.base import capped
from specjax.drafters.base import Drafter
from specjax.step_types import Proposal
from specjax.models import quantized
from specjax.models.block import Block
from specjax.models.config import ModelConfig
from specjax.models.transformer import attention_masks
from specjax.models.transformer import causal_mask
from specjax.models.transformer import default_positions

__all__ = ["Eagle", "EagleLayer", "EagleState", "layer_cache"]


def layer_cache(config: ModelConfig, batch: int, size: int,
                dtype: jnp.dtype = jnp.float32) -> cache_lib.KVCache:
  """An empty one-layer cache for an `EagleLayer` of `config`'s shape."""
  return cache_lib.KVCache.zeros(num_layers=1, batch=batch, size=size,
                                 num_kv_heads=config.num_kv_heads,
                                 head_dim=config.head_dim, dtype=dtype)


class EagleLayer(nn.Module):
  """fc([f; e]) then one decoder layer of the target's shape.

  Attributes:
    config: the target's config (hidden size, heads, MLP width, RoPE).
    param_dtype: dtype of the parameters.
  """

  config: ModelConfig
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, features: jax.Array, embeddings: jax.Array,
               cache: cache_lib.KVCache, cache_is_empty: bool = False
               ) -> tuple[jax.Array, cache_lib.KVCache]:
    """features, embeddings [B, T, E] at `cache.lengths` -> predicted next
    features [B, T, E], and the one-layer cache with the chunk written.
    `cache_is_empty` (static) promises every length is 0: attention then
    skips the cache (as the target's prefill does, which also keeps XLA
    from constant-folding attention over a zero cache)."""
    e = self.config.hidden_size
    x = nn.Dense(e, dtype=self.param_dtype, param_dtype=self.param_dtype,
                 name="fc")(jnp.concatenate([features, embeddings], -1))
    offsets = cache.lengths
    num_tokens = x.shape[1]
    positions = default_positions(offsets, num_tokens)
    cache_mask, chunk_mask = attention_masks(
        offsets, positions, causal_mask(num_tokens), cache.size,
        self.config.sliding_window)
    layer = Block(self.config, self.param_dtype, name="layer")
    if cache_is_empty:
      x, k, v = layer(x, None, None, positions, None, chunk_mask)
    else:
      x, k, v = layer(x, cache.k[0], cache.v[0], positions, cache_mask,
                      chunk_mask)
    k, v = cache_lib.after(x, k, v)  # the write after the read: no copy
    return x, cache.replace(
        k=cache_lib.write_rows(cache.k[0], k, offsets)[None],
        v=cache_lib.write_rows(cache.v[0], v, offsets)[None],
        lengths=offsets + num_tokens)


@flax.struct.dataclass(kw_only=True)
class EagleState:
  """What `Eagle` carries between steps.

  Attributes:
    cache: its one-layer KV cache over the committed pairs.
    feature: [B, E] its predicted feature at the last committed token's
      position (the input of the first draft).
  """

  cache: cache_lib.KVCache
  feature: jax.Array


@flax.struct.dataclass
class Eagle(Drafter):
  """Drafts a chain with an `EagleLayer` over the target's features.

  Attributes:
    target: the verified `Model` (its embedding and LM head, frozen).
    params: the `EagleLayer` parameters.
  """

  target: Any
  params: Any

  components = ("eagle",)
  supports_trees = False
  uses_prompt_hidden = True

  @property
  def vocab_size(self) -> int:
    return self.target.vocab_size

  @property
  def module(self) -> EagleLayer:
    return EagleLayer(self.target.config, self.target.dtype)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """tokens [...] -> the target's embeddings [..., E]."""
    return quantized.take(self.target.params["embed"], tokens)

  def step(self, features: jax.Array, tokens: jax.Array,
           cache: cache_lib.KVCache, cache_is_empty: bool = False
           ) -> tuple[jax.Array, Any]:
    """Pairs (features [B, T, E], tokens [B, T]) -> predicted next
    features [B, T, E], cache."""
    return self.module.apply({"params": self.params}, features,
                             self.embed(tokens), cache, cache_is_empty)

  def init(self, prompts, prompt_lengths, first_token, cache_size,
           prompt_hidden=None):
    if prompt_hidden is None:
      raise ValueError("Eagle needs the target's prompt features "
                       "(prompt_hidden); use it directly as the drafter.")
    batch, width = prompts.shape
    cache = layer_cache(self.target.config, batch, cache_size,
                        self.target.dtype)
    # Pair i: (f_i, t_{i+1}); the last prompt position pairs with the
    # first generated token.
    following = jnp.concatenate(
        [prompts[:, 1:], jnp.zeros((batch, 1), prompts.dtype)], 1)
    following = jnp.where(jnp.arange(width)[None] == (prompt_lengths - 1)[:,
                                                                        None],
                          first_token[:, None], following)
    predicted, cache = self.step(prompt_hidden, following, cache,
                                 cache_is_empty=True)
    feature = jnp.take_along_axis(
        predicted, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return EagleState(cache=cache.rollback(prompt_lengths), feature=feature)

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    keys = jax.random.split(key, gamma)
    base = state.cache.lengths
    batch = base.shape[0]
    cap = jnp.full((batch,), gamma, jnp.int32) if limit is None else limit

    def draw(i, feature):
      logits = self.target.logits(feature)  # [B, V]
      q = sampling.probabilities(logits, params)
      confidence = sampling.top_probability(logits)
      return sampling.sample(keys[i], q), q, confidence

    d0, q0, _ = draw(0, state.feature)
    vocab = q0.shape[-1]
    carry = dict(
        step=jnp.int32(1), feature=state.feature, cache=state.cache,
        tokens=jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(d0),
        q=jnp.zeros((batch, gamma, vocab), jnp.float32).at[:, 0].set(q0),
        num_drafted=jnp.minimum(cap, 1), drafting=cap > 1)

    def body(s):
      prev = jax.lax.dynamic_slice_in_dim(s["tokens"], s["step"] - 1, 1, 1)
      predicted, cache = self.step(s["feature"][:, None], prev, s["cache"])
      feature = predicted[:, 0]
      token, q, confidence = draw(s["step"], feature)
      drafting = s["drafting"] & (confidence >= stop_threshold)
      added = drafting.astype(jnp.int32)
      return dict(
          step=s["step"] + 1, feature=feature, cache=cache,
          tokens=jax.lax.dynamic_update_slice_in_dim(
              s["tokens"], token[:, None], s["step"], 1),
          q=jax.lax.dynamic_update_slice_in_dim(s["q"], q[:, None],
                                                s["step"], 1),
          num_drafted=s["num_drafted"] + added,
          drafting=drafting & (s["step"] + 1 < cap))

    carry = jax.lax.while_loop(
        lambda s: (s["step"] < gamma) & jnp.any(s["drafting"]), body, carry)
    proposal = Proposal(tokens=carry["tokens"], q=carry["q"],
                        num_drafted=capped(carry["num_drafted"], limit),
                        num_forwards=carry["step"] - 1)
    # Drafted pairs used predicted features: dropped; `commit` feeds the
    # target's.
    return proposal, state.replace(cache=carry["cache"].rollback(base))

  def commit(self, state, proposal, verification, active):
    del proposal
    if verification.hidden is None:
      raise ValueError("Eagle needs the target's hidden states; this "
                       "target's forward does not return them.")
    # The target's features at the verified positions pair with the
    # tokens that followed them: the emitted ones.
    base = state.cache.lengths
    predicted, cache = self.step(
        verification.hidden.astype(state.feature.dtype),
        verification.emitted, state.cache)
    at = verification.num_accepted  # the last emitted token's pair
    feature = jnp.take_along_axis(predicted, at[:, None, None], axis=1)[:, 0]
    return EagleState(
        cache=cache.rollback(jnp.where(active, base + at + 1, base)),
        feature=jnp.where(active[:, None], feature, state.feature))
