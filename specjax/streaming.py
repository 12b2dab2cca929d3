"""Streaming: each step's committed tokens handed to the host as they come.

Shape letters (`specjax.shapes`): B batch, W output buffer width, C tokens
committed per step at most (1 autoregressive, γ+1 speculative).

A generation stays one compiled call. With `on_tokens=callback`, each step
of its loop (and the prefill's first token) ends with one ordered
`jax.experimental.io_callback` carrying the buffer's new slots [B, C] and
each row's count of new tokens [B]: one host transfer per step. On the
host, `callback(new)` gets a list of B lists of token ids, the tokens each
row committed in that step (empty for a row that committed none), after
EOS and stop-string truncation, so the concatenated stream of a row is its
final output.

The callback is not part of the compiled program: the program calls one
module-level dispatcher with a traced stream id, and the dispatcher looks
the call's callback up (`open_stream`), so a new callback (a fresh lambda
each call) never recompiles. Whether a call streams at all is static.
`TextStream` turns ids into text deltas with a tokenizer.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Callable, Iterator, Sequence

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np

__all__ = ["TextStream", "deliver", "open_stream"]

Callback = Callable[[list[list[int]]], None]

_LOCK = threading.Lock()
_CALLBACKS: dict[int, Callback] = {}
_IDS = itertools.count(1)


@contextlib.contextmanager
def open_stream(callback: Callback | None) -> Iterator[np.ndarray | None]:
  """Registers `callback` for one generation; yields the stream id ([]
  int32 numpy, None for no callback) to pass into the compiled call."""
  if callback is None:
    yield None
    return
  if not callable(callback):
    raise TypeError(f"on_tokens must be callable, got "
                    f"{type(callback).__name__}.")
  with _LOCK:
    stream_id = next(_IDS) % (2**31 - 1)
    _CALLBACKS[stream_id] = callback
  try:
    yield np.int32(stream_id)
  finally:
    with _LOCK:
      _CALLBACKS.pop(stream_id, None)


def _dispatch(stream_id: np.ndarray, new: np.ndarray,
              num_new: np.ndarray) -> np.ndarray:
  """Host side: `new` [B, C] and `num_new` [B] -> the call's callback."""
  with _LOCK:
    callback = _CALLBACKS.get(int(stream_id))
  if callback is not None:
    callback([row[:max(int(n), 0)].tolist()
              for row, n in zip(np.asarray(new), np.asarray(num_new))])
  return np.int32(0)


def deliver(stream_id: jax.Array | None, tokens: jax.Array,
            before: jax.Array, after: jax.Array, slots: int) -> None:
  """In-graph: hands rows' tokens from `before` to `after` to the host.

  Args:
    stream_id: [] int32 the call's stream (`open_stream`), or None: then
      nothing is added to the program.
    tokens: [B, W] int32 the output buffer.
    before: [B] int32 counts before the step.
    after: [B] int32 counts after it (at most `slots` more).
    slots: C, static.
  """
  if stream_id is None:
    return
  index = before[:, None] + jnp.arange(slots)[None]  # [B, C]
  new = jnp.take_along_axis(tokens, jnp.minimum(index, tokens.shape[1] - 1),
                            axis=1)
  io_callback(_dispatch, jax.ShapeDtypeStruct((), jnp.int32), stream_id,
              new, after - before, ordered=True)


class TextStream:
  """A streaming callback that decodes: `on_text(b, delta)` gets each
  row's new text as it is committed.

  Tokens are decoded from the row's whole stream so far (a character may
  span several byte-level tokens); a trailing incomplete character (decoded
  as U+FFFD) is held back until its last byte arrives.

  Attributes:
    texts: each row's text so far.
    ids: each row's tokens so far.
  """

  def __init__(self, tokenizer, on_text: Callable[[int, str], None]
               | None = None):
    self._tokenizer = tokenizer
    self._on_text = on_text
    self.ids: list[list[int]] = []
    self.texts: list[str] = []

  def __call__(self, new: Sequence[Sequence[int]]) -> None:
    if not self.ids:
      self.ids = [[] for _ in new]
      self.texts = ["" for _ in new]
    for b, tokens in enumerate(new):
      if not tokens:
        continue
      self.ids[b].extend(tokens)
      # Held back: a trailing character whose bytes are not all in yet.
      text = self._tokenizer.decode(self.ids[b]).rstrip("\ufffd")
      if len(text) <= len(self.texts[b]):
        continue
      delta, self.texts[b] = text[len(self.texts[b]):], text
      if delta and self._on_text is not None:
        self._on_text(b, delta)
