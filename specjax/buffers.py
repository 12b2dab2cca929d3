"""Static-shape output buffers shared by the decoding loops.

Shape letters (`specjax.shapes`): B batch, N max new tokens (N_cap its
cap), C tokens emitted per step (1 for autoregressive decoding, γ+1 for
speculative), W = N_cap + C buffer width, Y end-of-sequence ids.

Tokens are written at each row's count with a per-row dynamic update; the
buffer has C slots of slack so a write never clamps. Stops (EOS, max tokens)
and stop strings (`specjax.stops`) are applied by truncating the count;
everything past it is padding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as cache_lib
from specjax import stops as stops_lib


def eos_array(eos_id) -> np.ndarray:
  """None | int | sequence of ints -> [Y] int32 (-1 never matches), a
  numpy array (`jnp.asarray` would compile a program per Y)."""
  if eos_id is None:
    ids = [-1]
  elif isinstance(eos_id, int):
    ids = [eos_id]
  else:
    ids = [int(i) for i in eos_id] or [-1]
  return np.asarray(ids, np.int32)


def emit(buffer: jax.Array, counts: jax.Array, done: jax.Array,
         tokens: jax.Array, num_new: jax.Array, eos_ids: jax.Array,
         max_new_tokens: int | jax.Array, stops: Any = None,
         stop_state: jax.Array | None = None
         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """Appends up to C tokens per active row and applies the stop rules.

  Args:
    buffer: [B, W] int32 output buffer, W >= max_new_tokens + C.
    counts: [B] int32 tokens generated so far.
    done: [B] bool rows that already stopped (left unchanged).
    tokens: [B, C] int32 candidates; the first `num_new[b]` are real.
    num_new: [B] int32 in [1, C].
    eos_ids: [Y] int32 end-of-sequence ids.
    max_new_tokens: N, an int or a traced [] int32 (<= the buffer's N_cap).
    stops: stop strings (`specjax.stops.StopStrings`), or None.
    stop_state: [B] int32 their automaton's state (None without stops).

  Returns:
    buffer, counts, done and the stop strings' state. A row stops after
    its first EOS (kept in the output), after the token that completes a
    stop string (kept), or when it reaches N tokens.
  """
  c = tokens.shape[1]
  real = jnp.arange(c)[None] < num_new[:, None]  # [B, C]
  is_eos = jnp.any(tokens[..., None] == eos_ids, axis=-1) & real
  has_eos = jnp.any(is_eos, axis=-1)
  num_new = jnp.where(has_eos, jnp.argmax(is_eos, axis=-1) + 1, num_new)
  ended = has_eos
  if stops is not None:
    moved, stop_at = stops_lib.advance(stops, stop_state, tokens, num_new)
    stopped = stop_at < num_new  # a stop string ends within the real tokens
    num_new = jnp.where(stopped, stop_at + 1, num_new)
    ended |= stopped
    stop_state = jnp.where(done, stop_state, moved)
  new_counts = jnp.minimum(counts + num_new, max_new_tokens)
  buffer = cache_lib.write_rows(buffer, tokens, counts)
  active = ~done
  counts = jnp.where(active, new_counts, counts)
  done |= active & (ended | (new_counts >= max_new_tokens))
  return buffer, counts, done, stop_state


def finalize(buffer: jax.Array, counts: jax.Array, width: int,
             pad_id: int) -> jax.Array:
  """[B, W] -> [B, width] with every slot at or past a row's count set to pad.

  `width` is static (N, or N_cap when N is traced; callers slice to N).
  """
  out = buffer[:, :width]
  keep = jnp.arange(width)[None] < counts[:, None]
  return jnp.where(keep, out, pad_id)
