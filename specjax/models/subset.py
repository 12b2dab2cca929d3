"""`LayerSubset`: a model run through some of its own layers.

Shape letters (`specjax.shapes`): B batch, T chunk, S cache size, E hidden,
V vocab, L layers.

Self-speculation drafts with the target itself, cheaper: LayerSkip
(Elhoushi et al. 2024) and Draft & Verify (Zhang et al. 2024) stop after
the first layers, or skip some, then apply the final norm and the LM head.
A `LayerSubset` is that cheaper model as a `LanguageModel`: it holds the
target's `Model` (the same parameter arrays, no copy) and a static tuple of
layer ranges, runs them one after another through the forward's
layer-range seam (`Transformer.__call__(layers=, residual=)`), and has its
own cache of `cache_layers` layers, of which only the layers it runs are
written. Its logits are those of the target's head over its last hidden
state, so it drafts with the target's vocabulary by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from specjax import cache as cache_lib
from specjax.models import moe
from specjax.models.decoder import Decoder
from specjax.models.protocol import array_bytes
from specjax.models.protocol import CostGeometry
from specjax.models.protocol import DeclaredModel
from specjax.models.transformer import TransformerOutput

__all__ = ["LayerSubset"]


@flax.struct.dataclass
class LayerSubset(Decoder, DeclaredModel):
  """Layers `ranges` of `model`, in order, then its final norm and head.

  Attributes:
    model: the full `Model` whose parameters it shares.
    ranges: static ((start, stop), ...) increasing, disjoint layer ranges.
  """

  model: Any  # a `specjax.models.Model`
  ranges: tuple[tuple[int, int], ...] = flax.struct.field(pytree_node=False)

  @classmethod
  def create(cls, model: Any, *, exit_layer: int | None = None,
             skip: Sequence[int] = ()) -> "LayerSubset":
    """Layers [0, exit_layer) of `model` (default: all L) but `skip`.

    Raises:
      ValueError: exit_layer outside [1, L), a skipped layer outside
        [0, exit_layer), or nothing left to run.
    """
    num_layers = model.config.num_layers
    stop = num_layers if exit_layer is None else exit_layer
    if exit_layer is not None and (
        isinstance(exit_layer, bool) or int(exit_layer) != exit_layer
        or not 1 <= exit_layer < num_layers):
      raise ValueError(f"exit_layer must be an integer in [1, {num_layers}) "
                       f"for a model of {num_layers} layers, got "
                       f"{exit_layer!r}.")
    skipped = sorted({int(i) for i in skip})
    outside = [i for i in skipped if not 0 <= i < stop]
    if outside:
      raise ValueError(f"skip lists layers {outside} outside the "
                       f"{stop} layers run (0 to {stop - 1}).")
    kept = [i for i in range(stop) if i not in skipped]
    if not kept:
      raise ValueError("skip leaves no layer to run.")
    ranges = []
    for i in kept:
      if ranges and ranges[-1][1] == i:
        ranges[-1][1] = i + 1
      else:
        ranges.append([i, i + 1])
    return cls(model=model, ranges=tuple(tuple(r) for r in ranges))

  @property
  def config(self):
    return self.model.config

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def dtype(self) -> jnp.dtype:
    return self.model.dtype

  @property
  def plan(self):
    return self.model.plan

  @property
  def cache_layers(self) -> int:
    """Layers of its cache: up to the last one it runs."""
    return self.ranges[-1][1]

  @property
  def num_layers_run(self) -> int:
    return sum(stop - start for start, stop in self.ranges)

  @property
  def weight_bytes_per_token(self) -> int:
    """Parameter bytes one forward reads: the layers it runs' share of
    the model's layers (a mixture of experts' active ones), and the
    embedding, final norm and head."""
    stack = {name: layer for name, layer in self.model.params.items()
             if name.startswith("layers")}
    layers = (sum(map(array_bytes, jax.tree.leaves(stack)))
              - moe.inactive_expert_bytes(self.model.config, stack))
    rest = self.model.weight_bytes_per_token - layers
    return rest + layers * self.num_layers_run // self.model.config.num_layers

  def cost_geometry(self) -> CostGeometry:
    """The model's, for the layers it runs; keyed apart from the full
    model's (`DeclaredModel`)."""
    full = self.model.cost_geometry()
    return dataclasses.replace(
        full, weight_bytes=float(self.weight_bytes_per_token),
        layers=self.num_layers_run,
        expert_bytes=(full.expert_bytes * self.num_layers_run
                      / self.model.config.num_layers),
        key=CostGeometry.identity(self.config, self.dtype, self.plan.name,
                                  f"layers={self.ranges}"))

  def init_cache(self, batch: int, size: int) -> cache_lib.KVCache:
    c = self.config
    return cache_lib.KVCache.zeros(
        num_layers=self.cache_layers, batch=batch, size=size,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=self.dtype).shard(self.model.mesh)

  def forward(self, tokens: jax.Array, cache: cache_lib.KVCache,
              **kwargs: Any) -> TransformerOutput:
    """tokens [B, T] through each range in turn (keywords as
    `Transformer.__call__`: positions, mask, cache_mask, cache_is_empty).
    The cache's `lengths` advance by T once."""
    for key in ("layers", "residual"):
      if kwargs.get(key) is not None:
        raise ValueError(f"LayerSubset chooses its own layers; got {key}=.")
    if not kwargs.get("write_cache", True):
      raise ValueError("LayerSubset writes its cache range by range; "
                       "write_cache=False is for a whole Model.")
    start = cache.lengths
    out, woken = None, []
    for first, stop in self.ranges:
      if out is not None:
        cache = out.cache.rollback(start)
      out = self.model.forward(
          tokens if out is None else None, cache, layers=(first, stop),
          residual=None if out is None else out.residual, **kwargs)
      woken.append(out.experts)
    return out.replace(experts=None if out.experts is None else sum(woken))

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> logits [..., V] float32, the model's head."""
    return self.model.logits(hidden)
