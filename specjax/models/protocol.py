"""What decoders need from a model: `LanguageModel` and `ModelOutput`.

Shape letters (`specjax.shapes`): B batch, T chunk, P padded prompt, E
hidden, V vocab.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import flax.struct
import jax


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
  """

  logits: jax.Array
  hidden: jax.Array | None = None
  residual: jax.Array | None = None
  layer_hidden: tuple[jax.Array, ...] = ()
  keys: jax.Array | None = None
  values: jax.Array | None = None


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
  does). `supports_compaction` tells; a recurrent cache (the README's GRU)
  need not.
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


def supports_compaction(cache: Any) -> bool:
  """Whether `cache` can commit non-prefix slots (`KVCache.compact`)."""
  return callable(getattr(cache, "compact", None))
