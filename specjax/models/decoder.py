"""`Decoder`: the forward-to-logits and prefill logic shared by models.

Shape letters (`specjax.shapes`): B batch, T chunk, P padded prompt, S cache
size, E hidden, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax import cache as cache_lib
from specjax.models.protocol import ModelOutput


# Prompt tokens per prefill pass when the prompt buffer is wider.
PREFILL_CHUNK = 64


def piece_sizes(chunk: int = PREFILL_CHUNK) -> list[int]:
  """Sizes of the one piece `Decoder.prefill` runs a prompt's rest in,
  after its whole chunks (the smallest that holds the rest): chunk/4,
  chunk/2 and chunk, ascending."""
  return sorted({max(chunk >> k, 1) for k in (2, 1, 0)})


def chunked(width: int, size: int, chunk: int | None = PREFILL_CHUNK
            ) -> bool:
  """Whether `Decoder.prefill` runs a prompt buffer of P = `width` in a
  cache of S = `size` in chunks of `chunk` rows (else one pass over the
  whole buffer): P a multiple of the chunk, wider than one, within S."""
  return not (chunk is None or width <= chunk or width % chunk
              or width > size)


def prefill_passes(longest: int, width: int, size: int,
                   chunk: int | None = PREFILL_CHUNK) -> list[int]:
  """Tokens per row of each forward `Decoder.prefill` runs for prompts
  whose longest has `longest` tokens, in a buffer P = `width` at S =
  `size`: where it chunks the buffer (`chunked`), floor(longest / chunk)
  chunks, then the smallest piece (`piece_sizes`) that holds the rest;
  else one pass over all P. (A scanned model, `MatmulPlan.scan_layers`,
  runs that piece as a whole chunk.)"""
  if not 1 <= longest <= width:
    raise ValueError(f"longest must be in [1, width={width}], got "
                     f"{longest}.")
  if not chunked(width, size, chunk):
    return [width]
  full, piece = prefill_split(longest, chunk)
  return [chunk] * full + ([piece] if piece else [])


def prefill_split(tokens: float, chunk: int = PREFILL_CHUNK
                  ) -> tuple[int, int]:
  """(whole chunks, size of the last piece or 0) that a chunked
  `Decoder.prefill` runs `tokens` prompt tokens (a mean may be
  fractional) in: the smallest of `piece_sizes` that holds the rest."""
  full, rest = divmod(tokens, chunk)
  return int(full), next(s for s in (0, *piece_sizes(chunk)) if rest <= s)


class Decoder:
  """`__call__` and `prefill` of the `LanguageModel` protocol, for a class
  with `forward` (a `Transformer.__call__`), `logits`, `config`, `plan` and
  `dtype`: `Model`, and `LayerSubset`, which runs some of a model's
  layers."""

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
                       residual=out.residual, layer_hidden=out.layer_hidden,
                       keys=out.keys, values=out.values,
                       experts=out.experts), out.cache

  def prefill(self, tokens: jax.Array, lengths: jax.Array,
              cache: cache_lib.KVCache, chunk: int | None = PREFILL_CHUNK,
              *, return_hidden: bool = False):
    """Right-padded prompts [B, P] -> last prompt logits [B, V], cache
    (and with `return_hidden`, the hidden states [B, P, E] of every prompt
    position, junk past each row's length, for drafters that read the
    target's features, e.g. EAGLE).

    A prompt buffer wider than `chunk` (a multiple of it) runs in chunks of
    `chunk` tokens in a `lax.fori_loop` up to the longest real prompt, then
    the rest in one piece of chunk/4, chunk/2 or chunk tokens, the
    smallest that holds it, so P can be a coarse bucket without costing
    compute; otherwise (or with `chunk=None`) one pass over all P
    positions.
    """
    batch, width = tokens.shape
    if not chunked(width, cache.size, chunk):
      out = self.forward(tokens, cache, cache_is_empty=True)
      hidden, cache = out.hidden, out.cache
      last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
      logits = self.logits(last[:, 0])  # [B, V]; the last prompt position
      if return_hidden:
        return logits, cache.rollback(lengths), hidden
      return logits, cache.rollback(lengths)

    def run(size, start, carry):
      cache, last, everything = carry
      piece = jax.lax.dynamic_slice_in_dim(tokens, start, size, axis=1)
      cache = cache.rollback(jnp.full((batch,), start, jnp.int32))
      out = self.forward(piece, cache, prefill=True)
      hidden, cache = out.hidden, out.cache  # [B, size, E]
      at = lengths - 1 - start  # the last prompt position, if in this piece
      here = jnp.take_along_axis(
          hidden, jnp.clip(at, 0, size - 1)[:, None, None], axis=1)[:, 0]
      inside = (at >= 0) & (at < size)
      if everything is not None:
        everything = jax.lax.dynamic_update_slice_in_dim(everything, hidden,
                                                         start, axis=1)
      return cache, jnp.where(inside[:, None], here, last), everything

    longest = jnp.max(lengths)
    full = longest // chunk
    last = jnp.zeros((batch, self.config.hidden_size), self.dtype)
    everything = jnp.zeros((batch, width, self.config.hidden_size),
                           self.dtype) if return_hidden else None
    carry = jax.lax.fori_loop(
        0, full, lambda i, c: run(chunk, i * chunk, c),
        (cache, last, everything))
    # The rest in one piece, the smallest of `sizes` that holds it:
    # fewer rows never cost more, on any machine. A scanned (GPU/TPU)
    # model, memory-bound at these sizes, keeps one size: each size is
    # another forward to compile.
    rest = longest - full * chunk
    sizes = [chunk] if self.plan.scan_layers else piece_sizes(chunk)
    pieces = [lambda c: c] + [
        functools.partial(run, size, full * chunk) for size in sizes]
    pick = jnp.where(rest > 0, 1 + jnp.searchsorted(
        jnp.asarray(sizes), rest), 0)
    cache, last, everything = jax.lax.switch(pick, pieces, carry)
    if return_hidden:
      return self.logits(last), cache.rollback(lengths), everything
    return self.logits(last), cache.rollback(lengths)
