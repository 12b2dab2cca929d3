"""The decoder object (`specjax.decoder.SpeculativeDecoder`): the same
programs and tokens as `decode.generate` / `speculative_generate`, text in
and out through its tokenizer, defaults taken from what it holds, and bad
input a new user might try named in the error."""

import numpy as np
import pytest

from specjax import decode
from specjax import drafters
from specjax import metrics
from specjax.decoder import SamplingConfig
from specjax.decoder import SpeculativeDecoder
from specjax.outputs import GenerateOutput
from specjax.outputs import SpecOutput

PROMPTS = [[5, 17, 3, 99, 42], [8, 8, 1]]
MAX_NEW = 12


class _Chars:
  """A tokenizer stand-in over the tiny pair's 128 ids: id i is the
  character chr(i), one byte."""

  special_ids = ()

  def __init__(self, eos_ids=()):
    self.eos_ids = tuple(eos_ids)

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)

  def token_bytes(self):
    return [bytes([i]) for i in range(128)]


def _first_new(row):
  """The first index of `row` whose token did not occur before it."""
  return next(i for i, t in enumerate(row) if t not in row[:i])


def test_greedy_speculative_equals_plain_and_the_wrappers(pair, baseline):
  target, draft = pair
  plain = SpeculativeDecoder(target).generate(PROMPTS, max_new_tokens=MAX_NEW)
  spec = SpeculativeDecoder(target, drafter=draft, gamma=3).generate(
      PROMPTS, max_new_tokens=MAX_NEW)
  wrapped = decode.speculative_generate(target, draft, PROMPTS, gamma=3,
                                        max_new_tokens=MAX_NEW)
  assert type(plain) is GenerateOutput and isinstance(spec, SpecOutput)
  for out in (plain, spec, wrapped):
    np.testing.assert_array_equal(out.tokens, baseline.tokens)
    np.testing.assert_array_equal(out.lengths, baseline.lengths)
  assert spec.gamma == 3 and int(spec.stats.target_forwards) > 0
  np.testing.assert_array_equal(spec.stats.accepted, wrapped.stats.accepted)
  assert plain.texts == () and baseline.seed == 0


def test_text_in_text_out_and_the_eos_default_from_the_tokenizer(pair):
  target, draft = pair
  ids = _Chars().encode("hi there")
  plain = decode.generate(target, [ids], max_new_tokens=MAX_NEW)
  row = plain.row(0)
  assert plain.lengths[0] == MAX_NEW  # the wrappers stop at no EOS
  cut = _first_new(row[2:]) + 2  # an id the row emits first at `cut`
  tok = _Chars(eos_ids=[row[cut]])
  out = SpeculativeDecoder(target, drafter=draft, tokenizer=tok).generate(
      "hi there", max_new_tokens=MAX_NEW)
  assert out.row(0) == row[:cut + 1]
  assert out.finish_reason == ("eos",)
  assert out.texts == (tok.decode(row[:cut + 1]),)
  # eos_id=() turns the tokenizer's default off; an explicit id wins.
  full = SpeculativeDecoder(target, drafter=draft, tokenizer=tok,
                            eos_id=()).generate(["hi there"],
                                                max_new_tokens=MAX_NEW)
  assert full.row(0) == row and full.finish_reason == ("length",)
  first = SpeculativeDecoder(target, tokenizer=tok, eos_id=row[0]).generate(
      "hi there", max_new_tokens=MAX_NEW)
  assert first.row(0) == row[:1]


def test_stop_strings_use_the_decoders_tokenizer(pair):
  target, _ = pair
  ids = _Chars().encode("hi there")
  row = decode.generate(target, [ids], max_new_tokens=MAX_NEW).row(0)
  cut = _first_new(row[1:]) + 1
  stop = chr(row[cut])
  out = SpeculativeDecoder(
      target, tokenizer=_Chars(), sampling=SamplingConfig(stop=[stop]),
  ).generate("hi there", max_new_tokens=MAX_NEW)
  assert out.row(0) == row[:cut + 1] and out.finish_reason == ("stop",)
  assert out.texts == (_Chars().decode(row[:cut]) + stop,)


def test_text_without_a_tokenizer_names_the_fix(pair):
  with pytest.raises(ValueError, match="no tokenizer: pass "
                     r"SpeculativeDecoder\(\.\.\., tokenizer=tok\)"):
    SpeculativeDecoder(pair[0]).generate("hi", max_new_tokens=4)
  with pytest.raises(ValueError, match="Prompt 0 is text"):
    decode.generate(pair[0], np.array(["hi"], object), max_new_tokens=4)


def _three_ways(pair, prompts, max_new_tokens):
  """Each way a new user may call: the two functions and the object."""
  target, draft = pair
  yield lambda: decode.generate(target, prompts,
                                max_new_tokens=max_new_tokens)
  yield lambda: decode.speculative_generate(
      target, draft, prompts, gamma=2, max_new_tokens=max_new_tokens)
  yield lambda: SpeculativeDecoder(target, drafter=draft).generate(
      prompts, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("prompts, max_new_tokens, match", [
    ([[1, 2]], 8.5, r"max_new_tokens must be an integer >= 1, got 8.5 "
     r"\(float\)"),
    ([[1, 2]], "8", r"max_new_tokens must be an integer"),
    ([[1.5, 2.0]], 4, r"Prompt 0 must hold integer token ids, got float64"),
    ([[1, 2], [3.0]], 4, r"Prompt 1 must hold integer token ids"),
    ([1, 2, 3], 4, r"a flat sequence of 3 ids\. For one prompt, wrap it"),
    (np.array([1, 2, 3]), 4, r"a flat sequence of 3 ids"),
    ([[[1, 2]]], 4, r"Prompt 0 must be a flat list of token ids"),
])
def test_bad_input_names_the_problem(pair, prompts, max_new_tokens, match):
  for call in _three_ways(pair, prompts, max_new_tokens):
    with pytest.raises(ValueError, match=match):
      call()


def test_an_unknown_sampling_keyword_is_named(pair):
  with pytest.raises(TypeError, match=r"generate\(\) got unexpected "
                     r"keyword arguments \['temprature'\]"):
    decode.generate(pair[0], PROMPTS, max_new_tokens=4, temprature=0.5)


def test_prompt_lookup_needs_no_vocabulary_size(pair, baseline):
  target, _ = pair
  lookup = drafters.PromptLookup()
  assert lookup.vocab_size is None
  assert lookup.for_target(target).vocab_size == target.vocab_size
  assert drafters.PromptLookup(7).for_target(target).vocab_size == 7
  # The control tokens: the tokenizer's where none were given.
  chat = _Chars()
  chat.special_ids = (5, 3)
  assert lookup.for_target(target).control_ids is None
  assert lookup.for_target(target, chat).control_ids == (3, 5)
  assert drafters.PromptLookup(control_ids=()).for_target(
      target, chat).control_ids == ()
  assert drafters.Fallback(lookup, drafters.DraftModel(pair[1])).for_target(
      target, chat).first.control_ids == (3, 5)
  for out in (
      SpeculativeDecoder(target, drafter=lookup, gamma=3).generate(
          PROMPTS, max_new_tokens=MAX_NEW),
      decode.speculative_generate(target, lookup, PROMPTS, gamma=3,
                                  max_new_tokens=MAX_NEW)):
    np.testing.assert_array_equal(out.tokens, baseline.tokens)
  with pytest.raises(ValueError, match="vocabularies differ.*7 tokens"):
    decode.speculative_generate(target, drafters.PromptLookup(7), PROMPTS,
                                gamma=3, max_new_tokens=MAX_NEW)


def test_summarize_takes_the_output_alone(pair):
  target, draft = pair
  out = SpeculativeDecoder(target, drafter=draft, gamma=3).generate(
      PROMPTS, max_new_tokens=MAX_NEW)
  summary = metrics.summarize(out)
  old = metrics.summarize(out.stats, gamma=3)
  assert summary["gamma"] == 3
  assert {k: summary[k] for k in old} == old
  assert summary["synthetic"] is False and summary["lossless"] is True
  assert metrics.summarize(out.stats, 3, 0.5)["predicted_speedup"] > 0
  with pytest.raises(TypeError, match="needs gamma="):
    metrics.summarize(out.stats)


def test_the_default_key_is_drawn_and_recorded(pair):
  # As gemma's Sampler.sample(rng=None): a fresh seed per call, kept in
  # the output so `key=out.seed` repeats the call; the functions keep 0.
  target, _ = pair
  decoder = SpeculativeDecoder(target, sampling=SamplingConfig(
      temperature=1.5))
  first = decoder.generate(PROMPTS, max_new_tokens=MAX_NEW)
  second = decoder.generate(PROMPTS, max_new_tokens=MAX_NEW)
  assert isinstance(first.seed, int) and first.seed != second.seed
  again = decoder.generate(PROMPTS, max_new_tokens=MAX_NEW, key=first.seed)
  np.testing.assert_array_equal(again.tokens, first.tokens)
  fixed = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW,
                          temperature=1.5)
  zero = decoder.generate(PROMPTS, max_new_tokens=MAX_NEW, key=0)
  assert fixed.seed == 0
  np.testing.assert_array_equal(fixed.tokens, zero.tokens)
