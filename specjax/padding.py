"""Prompt padding and the static shapes it fixes.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, N
max new tokens, N_cap its static cap.

A program is fixed by its static shapes, so the decoders round what varies
from call to call to few values:

- the prompt buffer P: the longest prompt rounded up to a power of two
  (16, 32, 64, 128, ...). `specjax.models.Model.prefill` runs a long prompt
  in chunks of 64 tokens, so its compute follows the real length, not P;
- the output buffer N_cap: `max_new_tokens` rounded up to a power of two,
  at least 64. N itself is traced;
- the default cache size S, a function of those two caps (P + N_cap +
  reserve, rounded up to 128).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["default_cache_size", "max_new_tokens_cap", "prepare_prompts",
           "output_cap", "prompt_bucket"]

_MIN_BUCKET = 16
_MIN_TOKENS_CAP = 64
_CACHE_ALIGN = 128


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def prompt_bucket(longest: int, cache_size: int | None = None) -> int:
  """P, the padded prompt width for a longest prompt of `longest` tokens.

  Powers of two from 16: few shapes to compile. Padding costs no compute
  for long prompts, which `Model.prefill` runs in 64-token chunks up to the
  longest real prompt.
  """
  bucket = max(_MIN_BUCKET, _pow2(longest))
  return bucket if cache_size is None else min(bucket, cache_size)


def max_new_tokens_cap(max_new_tokens: int) -> int:
  """N_cap, the static output width: N rounded up to a power of two >= 64."""
  return max(_MIN_TOKENS_CAP, _pow2(max_new_tokens))


def default_cache_size(longest: int, max_new_tokens: int, reserve: int = 1,
                       tokens_cap: int | None = None) -> int:
  """S when none is given: P + N_cap + `reserve`, rounded up to 128.

  A function of the caps only (`prompt_bucket`, `max_new_tokens_cap`), so it
  fixes no shape of its own.
  """
  fit = (prompt_bucket(longest) + output_cap(max_new_tokens, tokens_cap)
         + reserve)
  return -(-fit // _CACHE_ALIGN) * _CACHE_ALIGN


def prepare_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, *,
                    max_new_tokens: int, cache_size: int | None,
                    reserve: int = 1, tokens_cap: int | None = None,
                    reserve_note: str = ""
                    ) -> tuple[np.ndarray, np.ndarray, int]:
  """Validates prompts and pads them to a bucket.

  Args:
    prompts: B lists of token ids.
    vocab_size: V; every id must be in [0, V).
    max_new_tokens: N.
    cache_size: S, or None for `default_cache_size`.
    reserve: extra positions the loop may write past the N tokens (γ + 1 for
      speculative decoding).
    tokens_cap: N_cap (default `max_new_tokens_cap(N)`).
    reserve_note: what the reserve is made of, for the error message.

  Returns:
    tokens [B, P] int32 right-padded with 0, lengths [B] int32, and S.

  Raises:
    ValueError: on an empty batch or prompt, an out-of-range id, or a cache
      too small for the longest prompt plus N plus `reserve`.
  """
  if isinstance(prompts, (str, bytes)) or not len(prompts):
    raise ValueError("prompts must be a non-empty list of token-id lists.")
  rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
  for b, row in enumerate(rows):
    if row.size == 0:
      raise ValueError(f"Prompt {b} is empty; every prompt needs at least "
                       "one token (e.g. a BOS id).")
    if row.min() < 0 or row.max() >= vocab_size:
      raise ValueError(f"Prompt {b} has token ids outside [0, {vocab_size}).")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  lengths = np.array([r.size for r in rows], np.int32)
  longest = int(lengths.max())
  needed = longest + max_new_tokens + reserve
  if cache_size is None:
    cache_size = default_cache_size(longest, max_new_tokens, reserve,
                                    tokens_cap)
  elif needed > cache_size:
    raise ValueError(
        f"The cache is too short: the longest prompt has {longest} tokens, "
        f"plus max_new_tokens={max_new_tokens} plus {reserve} positions of "
        f"slack{reserve_note} needs {needed} positions, but "
        f"cache_size={cache_size}.")
  bucket = prompt_bucket(longest, cache_size)
  tokens = np.zeros((len(rows), bucket), np.int32)
  for b, row in enumerate(rows):
    tokens[b, :row.size] = row
  return tokens, lengths, cache_size


def output_cap(max_new_tokens: int, tokens_cap: int | None) -> int:
  """N_cap: `tokens_cap` (checked to hold N), or `max_new_tokens_cap(N)`."""
  if tokens_cap is None:
    return max_new_tokens_cap(max_new_tokens)
  if tokens_cap < max_new_tokens:
    raise ValueError(f"tokens_cap={tokens_cap} is below max_new_tokens="
                     f"{max_new_tokens}.")
  return tokens_cap


