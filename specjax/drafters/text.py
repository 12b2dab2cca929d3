"""Each row's committed text in a fixed [B, S] buffer.

Shape letters (`specjax.shapes`): B batch, S buffer size (the cache size), P
padded prompt, C tokens committed in one step, T tokens read.

Drafters that read the text (`PromptLookup`) or keep a model in step with it
(`track.Track`) hold it as `context` [B, S] int32 with `length` [B] valid
tokens: the prompt, the target's first token, then every committed token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import cache as cache_lib


def init(prompts: jax.Array, prompt_lengths: jax.Array,
         first_token: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """Prompts [B, P] and the target's first token [B] -> context [B, S],
  length [B]."""
  batch, width = prompts.shape
  context = jnp.zeros((batch, size), jnp.int32).at[:, :width].set(
      prompts.astype(jnp.int32))
  context = cache_lib.write_rows(context, first_token[:, None],
                                 prompt_lengths)
  return context, prompt_lengths + 1


def append(context: jax.Array, length: jax.Array, emitted: jax.Array,
           num_emitted: jax.Array, active: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
  """Appends emitted [B, C] (`num_emitted` [B] real) to active [B] rows.

  Room for the C slots is reserved by the engine's cache sizing.
  """
  written = cache_lib.write_rows(context, emitted, length)
  return (jnp.where(active[:, None], written, context),
          jnp.where(active, length + num_emitted, length))


def window(context: jax.Array, start: jax.Array, width: int) -> jax.Array:
  """context [B, S] read from [B] offsets -> [B, T=width]; indices are
  clipped into [0, S - 1], so callers mask what falls outside."""
  index = jnp.clip(start[:, None] + jnp.arange(width)[None], 0,
                   context.shape[1] - 1)
  return jnp.take_along_axis(context, index, axis=1)
