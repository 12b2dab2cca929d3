"""Prompt padding and the static shapes it fixes.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, N
max new tokens, N_cap its static cap.

A program is fixed by its static shapes, so the decoders derive every one of
them from one value, the cache size S, and round S to few values:

- the default S is a cache class: the positions a call needs (longest
  prompt + N + reserve) rounded up to a power of two, at least 256 for up
  to 64 rows. The prompt's length and N are traced within a class, so
  prompts of 5 to 600 tokens with any N <= 100 compile three programs per
  (B, γ) (256, 512 and 1024 positions; `tests/test_compile.py`). Larger
  batches keep B · S under `ROW_POSITIONS`, down to the positions the call
  needs: their caches and prefill activations grow with B · S, and a
  short call of many rows needs few positions;
- the prompt buffer P: S rounded down to a multiple of `PROMPT_ALIGN` (the
  prefill chunk of `specjax.models.decoder`), or S when the prompt would
  not fit. `Model.prefill` runs the prompt in 64-token chunks up to the
  longest real prompt (a traced length), so P costs no compute;
- the output buffer N_cap: S, unless `tokens_cap` is given. Any N a cache
  of S can hold fits; the buffer is int32, so its size is negligible.

Inputs go to the device as numpy arrays (`jax.device_put` or a jitted
call's transfer), never `jnp.asarray`, which compiles a program per shape.
A cache class costs at most twice the positions the call needs, read once
per layer per step: beside the weights, small at the pairs' shapes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["PROMPT_ALIGN", "cache_class", "check_max_new_tokens",
           "default_cache_size", "output_cap", "prepare_prompts",
           "prompt_bucket", "prompt_rows"]

MIN_CACHE = 256
# Row positions (B · S) a batch may spend on the floor `MIN_CACHE` (64 rows
# of 256): past it the floor shrinks with B, to the positions it needs.
ROW_POSITIONS = 64 * MIN_CACHE
PROMPT_ALIGN = 64  # specjax.models.decoder.PREFILL_CHUNK (a layer above)


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def cache_class(needed: int, batch: int = 1) -> int:
  """S for a call of B = `batch` rows that needs `needed` positions: a
  power of two >= needed, and >= 256 while B · 256 <= `ROW_POSITIONS`
  (module docstring)."""
  if needed < 1:
    raise ValueError(f"needed must be >= 1, got {needed}.")
  floor = min(MIN_CACHE, 1 << (max(ROW_POSITIONS // max(batch, 1), 1)
                               .bit_length() - 1))
  return max(floor, _pow2(needed))


def prompt_bucket(longest: int, cache_size: int | None = None) -> int:
  """P, the padded prompt width for a longest prompt of `longest` tokens in
  a cache of `cache_size` positions (default: the smallest class that
  holds the prompt).

  S rounded down to a multiple of `PROMPT_ALIGN` when that holds the
  prompt, else S: one P per S, so the prompt's length picks no program.
  """
  size = cache_class(longest + 1) if cache_size is None else cache_size
  aligned = size - size % PROMPT_ALIGN
  return aligned if aligned >= longest else size


def default_cache_size(longest: int, max_new_tokens: int, reserve: int = 1,
                       tokens_cap: int | None = None, batch: int = 1) -> int:
  """S when none is given: the class (`cache_class`) of the longest prompt
  + max(N, `tokens_cap`) + `reserve` positions, for B = `batch` rows."""
  return cache_class(longest + max(max_new_tokens, tokens_cap or 0)
                     + reserve, batch)


def check_max_new_tokens(max_new_tokens: int) -> int:
  """N as an int, or an error naming `max_new_tokens` and what it must be.

  Raises:
    ValueError: N is not an integer (a float, a bool, a string) or is
      below 1.
  """
  if isinstance(max_new_tokens, bool) or not isinstance(
      max_new_tokens, (int, np.integer)):
    raise ValueError("max_new_tokens must be an integer >= 1, got "
                     f"{max_new_tokens!r} ({type(max_new_tokens).__name__}).")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  return int(max_new_tokens)


def _prompt_row(b: int, prompt: Sequence[int], vocab_size: int
                ) -> np.ndarray:
  """Prompt b as [P_b] int64, or an error naming what is wrong with it."""
  if isinstance(prompt, (str, bytes)):
    raise ValueError(f"Prompt {b} is text ({prompt!r:.40}); token ids are "
                     "expected here: encode it first, or give the decoder "
                     "a tokenizer (decoder.SpeculativeDecoder(..., "
                     "tokenizer=tok)).")
  row = np.asarray(prompt)
  if row.ndim == 0:
    raise ValueError(f"Prompt {b} is one id ({prompt!r}), not a list of "
                     "token ids.")
  if row.ndim != 1:
    raise ValueError(f"Prompt {b} must be a flat list of token ids, got an "
                     f"array of shape {row.shape}.")
  if row.size == 0:
    raise ValueError(f"Prompt {b} is empty; every prompt needs at least "
                     "one token (e.g. a BOS id).")
  if row.dtype.kind not in "iu":
    raise ValueError(f"Prompt {b} must hold integer token ids, got "
                     f"{row.dtype} values ({row[:4].tolist()}...).")
  if row.min() < 0 or row.max() >= vocab_size:
    raise ValueError(f"Prompt {b} has token ids outside [0, {vocab_size}).")
  return row.astype(np.int64)


def _is_one_id(x: object) -> bool:
  """Whether x is a single token id (a number or 0-d array), not a list."""
  if isinstance(x, (str, bytes)):
    return False
  try:
    return np.ndim(x) == 0
  except ValueError:  # a ragged nested list: not one id
    return False


def prompt_rows(prompts: Sequence[Sequence[int]], vocab_size: int
                ) -> list[np.ndarray]:
  """Validated prompts: B lists of token ids -> B arrays [P_b] int64.

  Raises:
    ValueError: not a non-empty list of prompts (a string, a flat list or
      1-D array of ids), or a prompt that is empty, holds non-integers
      (floats are never rounded) or ids outside [0, V).
  """
  try:
    batch = 0 if isinstance(prompts, (str, bytes)) else len(prompts)
  except TypeError:  # no length: None, an int, a generator
    batch = 0
  if not batch:
    raise ValueError("prompts must be a non-empty list of token-id lists "
                     f"(B lists), got {prompts!r:.60}.")
  if all(_is_one_id(p) for p in prompts):
    raise ValueError(
        "prompts must be a list of prompts, each a list of token ids; got "
        f"a flat sequence of {batch} ids. For one prompt, wrap it: "
        "[ids].")
  return [_prompt_row(b, p, vocab_size) for b, p in enumerate(prompts)]


def prepare_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, *,
                    max_new_tokens: int, cache_size: int | None,
                    reserve: int = 1, tokens_cap: int | None = None,
                    reserve_note: str = ""
                    ) -> tuple[np.ndarray, np.ndarray, int]:
  """Validates prompts and pads them to a bucket.

  Args:
    prompts: B lists of token ids (`prompt_rows`).
    vocab_size: V; every id must be in [0, V).
    max_new_tokens: N.
    cache_size: S, or None for `default_cache_size`.
    reserve: extra positions the loop may write past the N tokens (γ + 1 for
      speculative decoding).
    tokens_cap: N_cap, if given (it then sizes the default S too).
    reserve_note: what the reserve is made of, for the error message.

  Returns:
    tokens [B, P] int32 right-padded with 0, lengths [B] int32, and S.

  Raises:
    ValueError: bad prompts (`prompt_rows`), a bad N
      (`check_max_new_tokens`), or a cache too small for the longest prompt
      plus N plus `reserve`.
  """
  rows = prompt_rows(prompts, vocab_size)
  max_new_tokens = check_max_new_tokens(max_new_tokens)
  lengths = np.array([r.size for r in rows], np.int32)
  longest = int(lengths.max())
  needed = longest + max_new_tokens + reserve
  if cache_size is None:
    cache_size = default_cache_size(longest, max_new_tokens, reserve,
                                    tokens_cap, batch=len(rows))
  elif needed > cache_size:
    raise ValueError(
        f"The cache is too short: the longest prompt has {longest} tokens, "
        f"plus max_new_tokens={max_new_tokens} plus {reserve} positions of "
        f"slack{reserve_note} needs {needed} positions, but "
        f"cache_size={cache_size}.")
  bucket = prompt_bucket(longest, cache_size)  # P
  tokens = np.zeros((len(rows), bucket), np.int32)
  for b, row in enumerate(rows):
    tokens[b, :row.size] = row
  return tokens, lengths, cache_size


def output_cap(max_new_tokens: int, tokens_cap: int | None,
               cache_size: int) -> int:
  """N_cap: `tokens_cap` (checked to hold N), else S = `cache_size`."""
  if tokens_cap is None:
    return cache_size
  if isinstance(tokens_cap, bool) or int(tokens_cap) != tokens_cap:
    raise ValueError(f"tokens_cap must be an integer, got {tokens_cap!r}.")
  if tokens_cap < max_new_tokens:
    raise ValueError(f"tokens_cap={tokens_cap} is below max_new_tokens="
                     f"{max_new_tokens}.")
  return int(tokens_cap)
