"""Llama-family models: `ModelConfig`, the Flax `Transformer`, and `Model`.

Shape letters: B batch, T chunk, P padded prompt, S cache size, E hidden,
V vocab.

`Model` is the handle loaders return and decoders take: a pytree whose leaves
are the parameters and whose static part is the config, so it can be passed
straight into `jax.jit`. Decoders only use the `LanguageModel` protocol below,
so any model (a fake with fixed logits, another Flax model with its own cache)
can be verified or drafted with by implementing three methods.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from specjax import cache as cache_lib
from specjax.models.config import ARCHITECTURES
from specjax.models.config import check_params
from specjax.models.config import flatten
from specjax.models.config import unflatten
from specjax.models.config import ModelConfig
from specjax.models.config import param_shapes
from specjax.models.config import RopeScaling
from specjax.models.matmul import MatmulPlan
from specjax.models.transformer import Transformer

__all__ = [
    "ARCHITECTURES", "LanguageModel", "MatmulPlan", "Model", "ModelConfig",
    "RopeScaling",
    "Transformer", "check_params", "init_random", "param_shapes",
]


# Prompt tokens per prefill pass when the prompt buffer is wider.
PREFILL_CHUNK = 64


class LanguageModel(Protocol):
  """What the decoders need from a model.

  The cache is any pytree with a `lengths` [B] int32 field and a
  `rollback(lengths)` method; `vocab_size` sizes the output buffers.

  Decoders rely on rollback being only "set `lengths`": a chunk may carry
  tokens past what a row keeps (prompt padding in `prefill`, rejected drafts
  in verification, a junk second token when the draft model catches up one
  token), and the row then resumes from a shorter length. A cache must
  therefore be able to resume from any length it has passed, e.g. keep
  per-position keys/values (transformers) or per-position states (RNNs).
  """

  vocab_size: int

  def init_cache(self, batch: int, size: int) -> Any:
    """An empty cache for `batch` rows of `size` positions."""

  def __call__(self, tokens: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    """tokens [B, T] at `cache.lengths` -> logits [B, T, V] float32, cache.

    The returned cache holds the chunk and has `lengths` advanced by T.
    """

  def prefill(self, tokens: jax.Array, lengths: jax.Array,
              cache: Any) -> tuple[jax.Array, Any]:
    """Right-padded prompts [B, P] with [B] lengths -> last logits [B, V].

    `cache` is fresh from `init_cache`. The returned cache has `lengths` set
    to the prompt lengths; what the padding wrote past them is stale.
    """


@flax.struct.dataclass
class Model:
  """A specjax transformer: static config plus a parameter pytree.

  Attributes:
    config: the hyper-parameters (static under jit).
    params: pytree laid out as `param_shapes(config)`, with the projection
      matrices transposed to [out, in] when `plan.layout` is "out_in".
    plan: how matrix products are computed (static; see `with_plan`).
  """

  config: ModelConfig = flax.struct.field(pytree_node=False)
  params: Any
  plan: MatmulPlan = flax.struct.field(pytree_node=False,
                                       default=MatmulPlan())

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def dtype(self) -> jnp.dtype:
    return self.params["embed"].dtype

  @property
  def weight_bytes_per_token(self) -> int:
    """Parameter bytes one decode step reads: all of them, except that the
    input embedding is only gathered (T rows) when a separate `lm_head`
    exists. Divided by memory bandwidth, the decode roofline."""
    total = sum(x.nbytes for x in jax.tree.leaves(self.params))
    if "lm_head" in self.params:
      total -= self.params["embed"].nbytes
    return total

  @property
  def module(self) -> Transformer:
    return Transformer(self.config, param_dtype=self.dtype, plan=self.plan)

  def with_plan(self, plan: MatmulPlan | str, *,
                donate: bool = False) -> "Model":
    """The same model computing its products as `plan` says.

    Switching between the "in_out" and "out_in" layouts transposes each
    projection matrix once. With `donate`, each old matrix is freed as its
    copy is made (this model is unusable afterwards), so the peak is the
    model plus its largest matrix; loaders do this.
    """
    if isinstance(plan, str):
      plan = MatmulPlan.parse(plan)
    params = self.params
    if plan.transposed != self.plan.transposed:
      flat = flatten(params)
      for path in _matrix_paths(self.config):
        flat[path] = (_transpose_donated if donate else _transpose)(
            flat[path])
      params = unflatten(self.config, lambda path, _: flat[path])
    return self.replace(params=params, plan=plan)

  def init_cache(self, batch: int, size: int) -> cache_lib.KVCache:
    c = self.config
    return cache_lib.KVCache.zeros(
        num_layers=c.num_layers, batch=batch, size=size,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype)

  def hidden(self, tokens: jax.Array, cache: cache_lib.KVCache,
             cache_is_empty: bool = False):
    """tokens [B, T] -> hidden [B, T, E], cache (see `Transformer`)."""
    return self.module.apply({"params": self.params}, tokens, cache,
                             cache_is_empty)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> logits [..., V] float32."""
    return self.module.apply({"params": self.params}, hidden,
                             method=Transformer.logits)

  def __call__(self, tokens: jax.Array, cache: cache_lib.KVCache):
    hidden, cache = self.hidden(tokens, cache)
    return self.logits(hidden), cache

  def prefill(self, tokens: jax.Array, lengths: jax.Array,
              cache: cache_lib.KVCache, chunk: int | None = PREFILL_CHUNK):
    """Right-padded prompts [B, P] -> last prompt logits [B, V], cache.

    A prompt buffer wider than `chunk` (a multiple of it) runs in chunks of
    `chunk` tokens in a `lax.while_loop` that stops after the longest real
    prompt, so P can be a coarse bucket without costing compute; otherwise
    (or with `chunk=None`) one pass over all P positions.
    """
    batch, width = tokens.shape
    if chunk is None or width <= chunk or width % chunk or width > cache.size:
      hidden, cache = self.hidden(tokens, cache, cache_is_empty=True)
      last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
      logits = self.logits(last[:, 0])  # [B, V]; the last prompt position
      return logits, cache.rollback(lengths)

    def body(i, carry):
      cache, last = carry
      start = i * chunk
      piece = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
      cache = cache.rollback(jnp.full((batch,), start, jnp.int32))
      hidden, cache = self.hidden(piece, cache)  # [B, chunk, E]
      at = lengths - 1 - start  # the last prompt position, if in this chunk
      here = jnp.take_along_axis(
          hidden, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
      inside = (at >= 0) & (at < chunk)
      return cache, jnp.where(inside[:, None], here, last)

    num_chunks = (jnp.max(lengths) + chunk - 1) // chunk
    last = jnp.zeros((batch, self.config.hidden_size), self.dtype)
    cache, last = jax.lax.fori_loop(0, num_chunks, body, (cache, last))
    return self.logits(last), cache.rollback(lengths)


# Projections whose storage layout a `MatmulPlan` chooses; `embed` is always
# [V, E] (gathered by token, and the tied head's [out, in]).
_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


def _matrix_paths(config: ModelConfig) -> list[str]:
  paths = [f"layers_{i}/{m}" for i in range(config.num_layers)
           for m in _MATRICES]
  return paths + ([] if config.tie_embeddings else ["lm_head"])


_transpose = jax.jit(jnp.transpose)
_transpose_donated = jax.jit(jnp.transpose, donate_argnums=0)


def init_random(config: ModelConfig, key: jax.Array,
                dtype: jnp.dtype = jnp.float32) -> Model:
  """A model with freshly initialised (random) parameters."""
  module = Transformer(config, param_dtype=dtype)
  cache = cache_lib.KVCache.zeros(
      num_layers=config.num_layers, batch=1, size=1,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)
  params = jax.jit(module.init)(key, jnp.zeros((1, 1), jnp.int32),
                                cache)["params"]
  return Model(config=config, params=params)
