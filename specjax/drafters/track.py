"""A model's KV cache kept in step with the committed text.

Shape letters (`specjax.shapes`): B batch, S cache size, P padded prompt, T
chunk, C tokens committed in one step, V vocab.

Model-based drafters (`DraftModel`, the middle model of a `Cascade`) keep,
beside the model's cache, the text itself in a [B, S] buffer: below
`length` the committed text, and past it the tokens the cache holds beyond
the committed text (this step's drafts). The cache holds
`context[:cache.lengths]`. Three operations keep them in step with whatever
the target commits, whichever drafter proposed:

- `catch_up` feeds the committed tokens the cache lacks, in chunks of T
  tokens in a `lax.while_loop`, so a drafter that sat out some steps (in a
  `Fallback`) catches up any number of tokens with static shapes;
- `rewind` makes `context[:base] + emitted` the committed text and keeps
  the cached positions that still match it: drafted tokens the target
  accepted stay cached, everything else is dropped;
- `keep_path`, after a token tree, moves the accepted path's keys and
  values from the slots the tree drafter left them in to consecutive
  slots after the old committed text (`KVCache.compact`, only those slots
  written), so they need not be fed again.

At least the last committed token is always left uncached, so `catch_up`
has a token to feed and returns the logits after it.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import cache as cache_lib
from specjax import rejection
from specjax.drafters import text
from specjax.models.protocol import model_output


@flax.struct.dataclass(kw_only=True)
class Track:
  """A model cache and the text it follows.

  Attributes:
    cache: the model's cache; it holds `context[:cache.lengths]`.
    context: [B, S] int32 committed text below `length`; past it, tokens
      the cache holds beyond the committed text.
    length: [B] int32 committed tokens.
  """

  cache: Any
  context: jax.Array
  length: jax.Array


def init(model: Any, prompts: jax.Array, prompt_lengths: jax.Array,
         first_token: jax.Array, cache_size: int, *,
         return_logits: bool = False) -> Track | tuple[Track, jax.Array]:
  """Prefills `model` on prompts [B, P]; the committed text is the prompt
  and `first_token` [B], which stays uncached. With `return_logits`, also
  the model's logits [B, V] after the prompt: its own guess at the token
  `first_token` is."""
  cache = model.init_cache(prompts.shape[0], cache_size)
  logits, cache = model.prefill(prompts, prompt_lengths, cache)
  context, length = text.init(prompts, prompt_lengths, first_token,
                              cache_size)
  state = Track(cache=cache, context=context, length=length)
  return (state, logits) if return_logits else state


def catch_up(model: Any, track: Track, *, width: int, keep: int = 0,
             first: int = 2, when: jax.Array | bool = True
             ) -> tuple[jax.Array, Track, jax.Array]:
  """Feeds the committed tokens the cache lacks but the last `keep`.

  One pass of `first` tokens covers the usual case (one or two tokens
  behind); `width`-token passes cover the rest (a drafter that sat out
  steps). Each pass runs only when some row still lacks tokens, and
  `when` ([] bool) holds. Both are `lax.while_loop`s, the first of at
  most one trip: a `lax.cond` whose other branch passed the cache through
  unchanged would make XLA copy the whole cache every step.

  Args:
    model: the track's `LanguageModel`.
    track: with at least `keep + 1` uncached committed tokens per row.
    width: T, tokens per later pass (static); the cache must have room for
      a pass at every row's length.
    keep: 0 or 1, committed tokens left unfed.
    first: tokens of the first pass (static).
    when: feed nothing unless this holds (a step that drafts nothing).

  Returns:
    logits [B, V] after the last token fed, the track, and the number of
    passes run ([] int32).
  """
  goal = track.length - keep  # [B]
  batch = goal.shape[0]

  def feed(size):
    def body(carry):
      cache, last, passes = carry
      start = cache.lengths
      count = jnp.clip(goal - start, 0, size)  # [B] real tokens this pass
      chunk = text.window(track.context, start, size)  # [B, T]
      out, cache = model(chunk, cache)
      logits = model_output(out).logits  # [B, T, V]
      here = jnp.take_along_axis(
          logits, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
      last = jnp.where((count > 0)[:, None], here, last)
      return cache.rollback(start + count), last, passes + 1
    return body

  behind = lambda carry: when & jnp.any(carry[0].lengths < goal)
  carry = (track.cache, jnp.zeros((batch, model.vocab_size), jnp.float32),
           jnp.int32(0))
  carry = jax.lax.while_loop(lambda c: behind(c) & (c[2] == 0),
                             feed(first), carry)
  cache, last, passes = jax.lax.while_loop(behind, feed(width), carry)
  return last, track.replace(cache=cache), passes


def write_scratch(track: Track, tokens: jax.Array) -> Track:
  """Records tokens [B, C] the cache holds past the committed text."""
  return track.replace(context=cache_lib.write_rows(
      track.context, tokens, track.length))


def rewind(track: Track, emitted: jax.Array, num_emitted: jax.Array,
           active: jax.Array) -> Track:
  """Appends emitted [B, C] (`num_emitted` [B] real) to the committed text
  of active [B] rows, keeping the cached positions that match it.

  The cache keeps what it held past the committed text only where those
  tokens equal the emitted ones (accepted drafts), and never the last
  emitted token. Inactive rows drop their drafts and keep their text.
  """
  base, cached = track.length, track.cache.lengths
  width = emitted.shape[1]
  slots = jnp.arange(width)[None]
  held = text.window(track.context, base, width)  # [B, C]
  same = ((held == emitted) & (slots < num_emitted[:, None])
          & (slots < (cached - base)[:, None]))
  match = jnp.minimum(rejection.leading_true(same), num_emitted - 1)
  kept = jnp.minimum(cached, base + match)
  context, length = text.append(track.context, base, emitted, num_emitted,
                                active)
  return Track(
      cache=track.cache.rollback(jnp.where(
          active, kept, jnp.minimum(cached, base - 1))),
      context=context, length=length)


def keep_path(track: Track, base: jax.Array, nodes: jax.Array,
              count: jax.Array, active: jax.Array) -> Track:
  """Caches the first `count` [B] nodes of an accepted tree path.

  Call after `rewind` has appended the path to the committed text.

  Args:
    track: rewound; its cache holds at most the `base` tokens committed
      before the step.
    base: [B] int32 committed tokens before the step; the tree drafter
      left node j's keys and values at slot `base + j`, at the position of
      its depth (`base - 1 + depth`), which is where the path puts it.
    nodes: [B, G] int32 node indices of the accepted path by depth
      (anything >= 0 past `count`).
    count: [B] int32 leading path nodes whose keys the drafter computed, at
      most the accepted count (the last committed token stays uncached).
    active: [B] rows the step committed.
  """
  cache = track.cache.compact(base[:, None] + nodes, base)
  return track.replace(cache=cache.rollback(
      jnp.where(active, base + count, track.cache.lengths)))
