"""What a generation returns: `GenerateOutput` and `SpecOutput`.

Shape letters (`specjax.shapes`): B batch, N max new tokens.

Outputs are numpy and frozen. Each holds everything its metrics need
(`specjax.metrics.summarize(out)`), the stop strings its text is cut at,
the seed that repeats it (`key=out.seed`) and, from a decoder with a
tokenizer (`specjax.decoder.SpeculativeDecoder`), each row's text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax import stops as stops_lib
from specjax.step_types import SpecStats

__all__ = ["GenerateOutput", "SpecOutput", "finish_reasons"]


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """Result of a generation (`SpeculativeDecoder.generate`,
  `decode.generate`).

  Attributes:
    tokens: [B, N] int32 generated ids, `pad_id` after each row's end.
    lengths: [B] int32 generated tokens per row (an EOS is counted and
      kept, and so is the token that completes a stop string).
    finish_reason: per row, "eos" (it emitted an EOS id), "stop" (a stop
      string) or "length" (N tokens).
    lossless: False when a lossy acceptance rule was used (the output is
      then not distributed as the target's).
    stop: the stop strings of the call (`text` cuts at them).
    seed: the int seed the call's key was made from (drawn when none was
      given: `key=out.seed` repeats the call); None for a key array.
    texts: each row's text (`text`), from a decoder with a tokenizer;
      empty otherwise.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  finish_reason: tuple[str, ...] = ()
  lossless: bool = True
  stop: tuple[str, ...] = ()
  seed: int | None = None
  texts: tuple[str, ...] = ()

  def row(self, b: int) -> list[int]:
    """The tokens generated for row b, without padding."""
    return self.tokens[b, :self.lengths[b]].tolist()

  def text(self, tokenizer: Any, b: int) -> str:
    """Row b decoded, cut where its stop string ends (the token that
    completes one may carry text past it)."""
    text = tokenizer.decode(self.row(b))
    return stops_lib.truncate_text(text, self.stop) if self.stop else text

  def with_texts(self, tokenizer: Any) -> "GenerateOutput":
    """This output with `texts` decoded by `tokenizer`."""
    return dataclasses.replace(self, texts=tuple(
        self.text(tokenizer, b) for b in range(len(self.lengths))))


@dataclasses.dataclass(frozen=True)
class SpecOutput(GenerateOutput):
  """Result of a speculative generation.

  Attributes:
    stats: counters (see `specjax.speculate.SpecStats`), as numpy arrays.
    gamma: γ used (γ_max under an adaptive policy).
    synthetic: True when acceptance was synthetic (fixed-rate, not
      distribution-preserving): such figures must be labelled synthetic.
    policy: "" for a fixed γ, else the adaptive policy ("auto",
      "heuristic").
    policy_state: the policy's final state (`policies.PolicyState`,
      numpy; None for a fixed γ): `policy.warm(policy_state)` carries
      what it learned into the next call.
  """

  stats: SpecStats = None
  gamma: int = 0
  synthetic: bool = False
  policy: str = ""
  policy_state: Any = None


def finish_reasons(tokens: np.ndarray, lengths: np.ndarray,
                   eos_ids: np.ndarray, stops: Any) -> tuple[str, ...]:
  """Per row: "eos" if its last token is an EOS id, "stop" if a stop
  string ends at it, else "length".

  Args:
    tokens: [B, N] generated ids.
    lengths: [B] generated tokens per row.
    eos_ids: [Y] int32 EOS ids (`buffers.eos_array`; -1 never matches).
    stops: the call's `specjax.stops.StopStrings`, or None.
  """
  eos = set(np.asarray(eos_ids).tolist())
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  reasons = []
  for row, n in zip(tokens, lengths):
    if n and int(row[n - 1]) in eos:
      reasons.append("eos")
    elif n and stops is not None and stops_lib.stop_index(
        stops, row[:n]) == n - 1:
      reasons.append("stop")
    else:
      reasons.append("length")
  return tuple(reasons)
