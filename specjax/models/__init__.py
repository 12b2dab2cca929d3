"""Llama-family models: `ModelConfig`, the Flax `Transformer`, and `Model`.

Shape letters (`specjax.shapes`): B batch, T chunk, P padded prompt, S cache
size, E hidden, V vocab.

`Model` is the handle loaders return and decoders take: a pytree whose leaves
are the parameters and whose static part is the config, so it can be passed
straight into `jax.jit`. Decoders only use the `LanguageModel` protocol
(`specjax.models.protocol`), so any model (a fake with fixed logits, another
Flax model with its own cache) can be verified or drafted with by implementing
three methods.
"""

from __future__ import annotations

import functools
from typing import Any

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
from specjax.models.protocol import LanguageModel
from specjax.models.protocol import ModelOutput
from specjax.models.protocol import model_output
from specjax.models.protocol import supports_compaction
from specjax.models.transformer import Transformer
from specjax.models.transformer import TransformerOutput

__all__ = [
    "ARCHITECTURES", "LanguageModel", "MatmulPlan", "Model", "ModelConfig",
    "ModelOutput", "RopeScaling", "Transformer", "TransformerOutput",
    "check_params", "init_random", "model_output", "param_shapes",
    "supports_compaction",
]


# Prompt tokens per prefill pass when the prompt buffer is wider.
PREFILL_CHUNK = 64


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

  def forward(self, tokens: jax.Array | None, cache: cache_lib.KVCache,
              **kwargs) -> TransformerOutput:
    """The full pass (`Transformer.__call__`, every keyword there):
    hidden states, residual stream, chosen layers' outputs and the cache."""
    return self.module.apply({"params": self.params}, tokens, cache, **kwargs)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> logits [..., V] float32."""
    return self.module.apply({"params": self.params}, hidden,
                             method=Transformer.logits)

  def __call__(self, tokens: jax.Array | None, cache: cache_lib.KVCache, *,
               positions: jax.Array | None = None,
               mask: jax.Array | None = None, **kwargs):
    """tokens [B, T] -> `ModelOutput` (logits [B, T, V], hidden [B, T, E]),
    cache. `positions` [B, T] and `mask` [B or 1, T, T] set the chunk's
    geometry (default: consecutive after `cache.lengths`, causal); other
    keywords (`layers`, `residual`, `hidden_layers`) go to `forward`."""
    out = self.forward(tokens, cache, positions=positions, mask=mask,
                       **kwargs)
    return ModelOutput(logits=self.logits(out.hidden), hidden=out.hidden,
                       residual=out.residual,
                       layer_hidden=out.layer_hidden), out.cache

  def prefill(self, tokens: jax.Array, lengths: jax.Array,
              cache: cache_lib.KVCache, chunk: int | None = PREFILL_CHUNK):
    """Right-padded prompts [B, P] -> last prompt logits [B, V], cache.

    A prompt buffer wider than `chunk` (a multiple of it) runs in chunks of
    `chunk` tokens in a `lax.fori_loop` up to the longest real prompt, then
    the rest in one piece of chunk/4, chunk/2 or chunk tokens, the
    smallest that holds it, so P can be a coarse bucket without costing
    compute; otherwise (or with `chunk=None`) one pass over all P
    positions.
    """
    batch, width = tokens.shape
    if chunk is None or width <= chunk or width % chunk or width > cache.size:
      out = self.forward(tokens, cache, cache_is_empty=True)
      hidden, cache = out.hidden, out.cache
      last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
      logits = self.logits(last[:, 0])  # [B, V]; the last prompt position
      return logits, cache.rollback(lengths)

    def run(size, start, carry):
      cache, last = carry
      piece = jax.lax.dynamic_slice_in_dim(tokens, start, size, axis=1)
      cache = cache.rollback(jnp.full((batch,), start, jnp.int32))
      out = self.forward(piece, cache)
      hidden, cache = out.hidden, out.cache  # [B, size, E]
      at = lengths - 1 - start  # the last prompt position, if in this piece
      here = jnp.take_along_axis(
          hidden, jnp.clip(at, 0, size - 1)[:, None, None], axis=1)[:, 0]
      inside = (at >= 0) & (at < size)
      return cache, jnp.where(inside[:, None], here, last)

    longest = jnp.max(lengths)
    full = longest // chunk
    last = jnp.zeros((batch, self.config.hidden_size), self.dtype)
    carry = jax.lax.fori_loop(
        0, full, lambda i, c: run(chunk, i * chunk, c), (cache, last))
    # The rest in one piece, the smallest of `sizes` that holds it:
    # fewer rows never cost more, on any machine.
    rest = longest - full * chunk
    sizes = sorted({max(chunk >> k, 1) for k in (2, 1, 0)})
    pieces = [lambda c: c] + [
        functools.partial(run, size, full * chunk) for size in sizes]
    pick = jnp.where(rest > 0, 1 + jnp.searchsorted(
        jnp.asarray(sizes), rest), 0)
    cache, last = jax.lax.switch(pick, pieces, carry)
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
