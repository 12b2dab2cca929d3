"""What decoders need from a model: `LanguageModel` and `ModelOutput`,
and what a model declares beyond them: `DeclaredModel`, `CostGeometry`.

Shape letters (`specjax.shapes`): B batch, T chunk, P padded prompt, E
hidden, V vocab, L layers, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, runtime_checkable

import flax.struct
import jax
import numpy as np


@flax.struct.dataclass(kw_only=True)
class ModelOutput:
  """One forward's outputs.

  Attributes:
    logits: [B, T, V] float32.
    hidden: [B, T, E] the last layer's output (the LM head's input), or None
      for a model that does not expose it.
    residual: [B, T, E] the residual stream before the final norm, or None.
    layer_hidden: [B, T, E] outputs of the layers a caller asked for.
    keys: [L, B, T, K, D] the chunk's keys when the model was asked not to
      write its cache (`write_cache=False`, a `Model`), else None.
    values: [L, B, T, K, D] the same for values.
    experts: [] int32 for a mixture of experts, the distinct experts the
      pass woke, summed over its layers; else None.
  """

  logits: jax.Array
  hidden: jax.Array | None = None
  residual: jax.Array | None = None
  layer_hidden: tuple[jax.Array, ...] = ()
  keys: jax.Array | None = None
  values: jax.Array | None = None
  experts: jax.Array | None = None


def model_output(result: jax.Array | ModelOutput) -> ModelOutput:
  """A `LanguageModel`'s `__call__` result (logits or `ModelOutput`) as a
  `ModelOutput`."""
  if isinstance(result, ModelOutput):
    return result
  return ModelOutput(logits=result)


@runtime_checkable
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

  A cache may also support compaction, `compact(src_slots [B, T], lengths
  [B])`: copy chosen slots to consecutive positions after `lengths` (a
  commit that is not a prefix, as in token trees; `specjax.cache.KVCache`
  does). `supports_compaction` tells; a recurrent cache (docs/api.md's GRU)
  need not.

  These four members are all a model must have. What else the engine may
  use, a model declares by subclassing `DeclaredModel`, whose defaults a
  model that implements this protocol alone gets (`declared`).
  """

  vocab_size: int

  def init_cache(self, batch: int, size: int) -> Any:
    """An empty cache for `batch` rows of `size` positions."""

  def __call__(self, tokens: jax.Array,
               cache: Any) -> tuple[jax.Array | ModelOutput, Any]:
    """tokens [B, T] at `cache.lengths` -> logits [B, T, V] float32 (or a
    `ModelOutput` holding them, and hidden states), cache.

    The returned cache holds the chunk and has `lengths` advanced by T.
    Decoders read the result through `model_output`. A model that also
    takes `positions` [B, T] and `mask` [B, T, T] keywords (as
    `specjax.models.Model` does) can verify token trees.
    """

  def prefill(self, tokens: jax.Array, lengths: jax.Array,
              cache: Any) -> tuple[jax.Array, Any]:
    """Right-padded prompts [B, P] with [B] lengths -> last logits [B, V].

    `cache` is fresh from `init_cache`. The returned cache has `lengths` set
    to the prompt lengths; what the padding wrote past them is stale.
    """


def array_bytes(x: jax.Array | np.ndarray | jax.ShapeDtypeStruct) -> int:
  """Bytes of an array from its shape and dtype: also for the
  `jax.ShapeDtypeStruct`s that stand for parameters when a program is
  compiled ahead of time (`specjax.aot`)."""
  return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


@dataclasses.dataclass(frozen=True)
class CostGeometry:
  """What one forward of a model reads and computes, for pricing it
  (`specjax.policies.costs.Roofline`) and for telling its measured costs
  from another model's (`specjax.policies.costs.table_key`).

  Attributes:
    weight_bytes: parameter bytes one forward reads.
    itemsize: bytes per parameter, so that a forward of T tokens costs
      2 · T · weight_bytes / itemsize FLOPs in its matrices.
    layers: L, attention layers run, each reading its K/V cache.
    num_heads: H per layer.
    num_kv_heads: K per layer.
    head_dim: D.
    key: what tells this model's measured cost tables from another's on
      one machine (config, layers run, dtype, matmul plan; `identity`).
    num_experts: X experts per layer of a mixture of experts (0: dense).
    experts_per_token: k experts each token row wakes per layer.
    expert_bytes: bytes of one expert's matrices over the layers run;
      `weight_bytes` counts k of them.
  """

  weight_bytes: float
  itemsize: int = 4
  layers: int = 0
  num_heads: int = 0
  num_kv_heads: int = 0
  head_dim: int = 0
  key: str = ""
  num_experts: int = 0
  experts_per_token: int = 0
  expert_bytes: float = 0.0

  def distinct_experts(self, rows: float) -> float:
    """E[distinct experts per layer] a pass of `rows` token rows wakes,
    each row choosing k of X as if at random: X (1 - (1 - k/X)^rows); k
    for one row, and X as rows grow (0 for a dense model)."""
    if not self.num_experts:
      return 0.0
    x, k = self.num_experts, self.experts_per_token
    return x * (1.0 - (1.0 - k / x) ** rows)

  def bytes_read(self, rows: float) -> float:
    """Parameter bytes a pass of `rows` token rows reads: a dense model's
    weights once, a mixture of experts' the union of its rows' experts
    (`distinct_experts`), so that a longer verification pass costs more."""
    extra = self.distinct_experts(rows) - self.experts_per_token
    return self.weight_bytes + self.expert_bytes * max(extra, 0.0)

  @property
  def kv_bytes_per_slot(self) -> float:
    """K/V cache bytes a forward reads per row and cache slot."""
    return (2.0 * self.layers * self.num_kv_heads * self.head_dim
            * self.itemsize)

  @property
  def attention_flops_per_slot(self) -> float:
    """Attention FLOPs per query row and cache slot."""
    return 4.0 * self.layers * self.num_heads * self.head_dim

  @staticmethod
  def identity(config: Any, dtype: Any, plan: str, part: str = "") -> str:
    """`key` for a model of `config` in `dtype` under a matmul plan named
    `plan`, or `part` of such a model (e.g. some of its layers)."""
    return f"{config}|{part}|{dtype}|{plan}"

  @classmethod
  def of_arrays(cls, model: LanguageModel) -> "CostGeometry":
    """The default: every array leaf of the pytree `model` read once per
    forward, no attention cache, and a key that says only the class (a
    model that declares nothing)."""
    leaves = [x for x in jax.tree.leaves(model) if isinstance(x, _ARRAYS)]
    return cls(weight_bytes=float(max(sum(map(array_bytes, leaves)), 1)),
               itemsize=np.dtype(leaves[0].dtype).itemsize if leaves else 4,
               key=cls.identity(type(model).__qualname__, "", ""))


class DeclaredModel:
  """A `LanguageModel`'s declared capabilities, with their defaults:
  subclass it (as `specjax.models.Model` and `LayerSubset` do) and
  override what differs. A model that implements `LanguageModel` without
  it has these defaults (`declared`).

  Attributes:
    defers_cache_writes: `__call__(tokens, cache, write_cache=False)`
      returns the chunk's keys and values (`ModelOutput.keys`, `values`)
      instead of writing them, and the cache has `write(keys, values,
      start)`, so that a verifier switching between widths writes the
      cache once after the switch (`specjax.verify.verify_within`).
  """

  defers_cache_writes: ClassVar[bool] = False

  def cost_geometry(self) -> CostGeometry:
    """What one forward reads and computes (default: every array leaf of
    the model, once, and no attention; `CostGeometry.of_arrays`)."""
    return CostGeometry.of_arrays(self)

  def for_branches(self, rows: int) -> LanguageModel:
    """This model as a generation whose passes have at most `rows` rows
    should hold it before its loop (`specjax.loops.speculative_loop`):
    with what XLA would hoist out of a loop body, but not out of the
    width branches of an adaptive step (`specjax.verify.verify_within`),
    computed once. The default: the model itself."""
    del rows
    return self


@dataclasses.dataclass(frozen=True)
class _Defaults(DeclaredModel):
  """The declarations of a model that implements `LanguageModel` alone."""

  model: LanguageModel

  def cost_geometry(self) -> CostGeometry:
    return CostGeometry.of_arrays(self.model)

  def for_branches(self, rows: int) -> LanguageModel:
    del rows
    return self.model


def declared(model: LanguageModel) -> DeclaredModel:
  """What `model` declares: itself where it subclasses `DeclaredModel`,
  else the defaults. The one place a model's declarations are looked up,
  so that a model written against `LanguageModel` alone (docs/api.md's
  GRU) is priced and verified as the defaults say."""
  return model if isinstance(model, DeclaredModel) else _Defaults(model)


def supports_compaction(cache: Any) -> bool:
  """Whether `cache` can commit non-prefix slots (`KVCache.compact`)."""
  return callable(getattr(cache, "compact", None))
