"""Generation controls: the logit processors a call runs, and their history.

Shape letters (`specjax.shapes`): B batch, V vocab, C tokens committed in
one step, G = γ draft tokens, T tree nodes.

`Controls` is the tuple of `specjax.processors` a call applies to every
distribution it samples or verifies, in order, each with the history it
reads. `resolve` builds it from the keywords of `generate` and
`speculative_generate` (`decoder.SamplingConfig`): a control left at None
is not in the program at all, and every value is traced, so changing one
never recompiles.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Mapping, Sequence

import flax.struct
import jax
import numpy as np

from specjax import grammar as grammar_lib
from specjax import processors as proc
from specjax import stops as stops_lib

__all__ = ["Controls", "resolve"]


@flax.struct.dataclass
class Controls:
  """Processors applied in order, with their state per row and position.

  Attributes:
    processors: the `specjax.processors.Processor`s, non-empty.
  """

  processors: tuple[proc.Processor, ...]

  @classmethod
  def create(cls, vocab_size: int, *, repetition_penalty: float | None = None,
             presence_penalty: float | None = None,
             frequency_penalty: float | None = None,
             logit_bias: Mapping[int, float] | None = None,
             grammar: Any = None,
             processors: Sequence[proc.Processor] = ()
             ) -> "Controls | None":
    """The built-in processors these settings turn on, in the module
    order, with `processors` before the grammar's mask; None when there
    are none.

    Raises:
      ValueError: a penalty outside its range, a bias for a token outside
        the vocabulary, or a processor that is not one.
    """
    made = []
    value = proc.setting("repetition_penalty", repetition_penalty)
    if value is not None:
      made.append(proc.RepetitionPenalty(rho=value))
    value = proc.setting("frequency_penalty", frequency_penalty)
    if value is not None:
      made.append(proc.FrequencyPenalty(penalty=value))
    value = proc.setting("presence_penalty", presence_penalty)
    if value is not None:
      made.append(proc.PresencePenalty(penalty=value))
    if logit_bias is not None:
      made.append(proc.LogitBias.create(logit_bias, vocab_size))
    for extra in processors:
      if not isinstance(extra, proc.Processor):
        raise ValueError("processors must be specjax.processors.Processor "
                         f"objects, got {type(extra).__name__}.")
      made.append(extra)
    if grammar is not None:
      made.append(proc.GrammarMask(grammar=grammar))
    return cls(processors=tuple(made)) if made else None

  def find(self, kind: type) -> proc.Processor | None:
    """The first processor of class `kind`, or None."""
    return next((p for p in self.processors if isinstance(p, kind)), None)

  def _each(self, move: Callable[[proc.Processor], proc.Processor]
            ) -> "Controls":
    return self.replace(processors=tuple(map(move, self.processors)))

  def start(self, prompts: jax.Array, lengths: jax.Array,
            vocab_size: int) -> "Controls":
    """The state before the first generated token, from prompts [B, P]
    int32 (right-padded) of lengths [B]."""
    return self._each(lambda p: p.start(prompts, lengths, vocab_size))

  def advance(self, tokens: jax.Array, take: jax.Array | None = None
              ) -> "Controls":
    """The state after one more token [B] in the rows where take [B]
    holds (default all)."""
    return self._each(lambda p: p.advance(tokens, take))

  def advance_many(self, tokens: jax.Array, num_new: jax.Array
                   ) -> "Controls":
    """The state after each row's first num_new [B] of tokens [B, C]."""
    out = self
    for i in range(tokens.shape[1]):
      out = out.advance(tokens[:, i], i < num_new)
    return out

  def along_chain(self, tokens: jax.Array) -> "Controls":
    """The state at each position of a verified chain: [B] -> [B, G+1],
    position i after drafts [B, G] tokens[:, :i]."""
    return self._each(lambda p: p.along_chain(tokens))

  def along_tree(self, tokens: jax.Array, parents: jax.Array,
                 ancestors: jax.Array) -> "Controls":
    """The state at the root and after each node of a token tree: [B] ->
    [B, T+1] (`Processor.along_tree`)."""
    return self._each(lambda p: p.along_tree(tokens, parents, ancestors))

  def apply(self, logits: jax.Array) -> jax.Array:
    """Processed logits [..., V] float32, each processor in turn."""
    for p in self.processors:
      logits = p.apply(logits)
    return logits


def _tokenizer_for(what: str, tokenizer: Any) -> Any:
  """`tokenizer`, or a clear error naming what needs it."""
  if tokenizer is None:
    raise ValueError(f"{what} needs the model's tokenizer: pass "
                     "tokenizer= (a specjax.tokenizer.Tokenizer), since "
                     "matching happens on the bytes tokens decode to.")
  return tokenizer


@functools.lru_cache(maxsize=16)
def _stop_strings(tokenizer: Any, stop: tuple[str, ...],
                  vocab_size: int) -> Any:
  return stops_lib.compile_stops(stop, tokenizer.token_bytes(),
                                 vocab_size=vocab_size)


@functools.lru_cache(maxsize=8)
def _grammar(tokenizer: Any, regex: str | None, schema: str | None,
             eos_ids: tuple[int, ...], vocab_size: int) -> Any:
  return grammar_lib.compile_grammar(tokenizer, regex=regex,
                                     json_schema=schema, eos_ids=eos_ids,
                                     vocab_size=vocab_size)


def resolve(vocab_size: int, *, tokenizer: Any = None, eos_id: Any = None,
            stop: Sequence[str] | None = None, regex: str | None = None,
            json_schema: Mapping[str, Any] | str | None = None,
            **settings: Any) -> tuple["Controls | None", Any]:
  """The `Controls` and stop strings (`specjax.stops.StopStrings`) for the
  keywords of `generate` and `speculative_generate`; None for what is off.
  `settings`: `Controls.create`'s keywords (penalties, bias, processors).

  Stop tables and grammars are compiled once per (tokenizer, strings) and
  kept (an LRU cache): a repeated call compiles nothing on the host.

  Raises:
    ValueError: an invalid control, or stop strings or a grammar without a
      tokenizer (or a grammar without an EOS id).
  """
  stops = None
  if stop is not None:
    stop = stops_lib.validate(stop)
    if stop:
      stops = _stop_strings(_tokenizer_for("stop", tokenizer), stop,
                            vocab_size)
  grammar = None
  if regex is not None or json_schema is not None:
    if regex is not None and json_schema is not None:
      raise ValueError("Pass regex= or json_schema=, not both.")
    tokenizer = _tokenizer_for("regex= / json_schema=", tokenizer)
    if eos_id is None:
      raise ValueError("Structured output needs eos_id= (the grammar "
                       "allows it where the text is complete).")
    if json_schema is not None and not isinstance(json_schema, str):
      json_schema = json.dumps(json_schema, sort_keys=True)
    eos = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(
        int(i) for i in eos_id)
    grammar = _grammar(tokenizer, regex, json_schema, eos, vocab_size)
  return Controls.create(vocab_size, grammar=grammar, **settings), stops
