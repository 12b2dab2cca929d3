"""Prompt-lookup drafting: the n-gram match against a brute-force reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax.drafters.lookup import ngram_match
from specjax.drafters.lookup import PromptLookup


def _reference(row, length, gamma, max_ngram, min_ngram):
  """Python loops: the latest earlier occurrence of the longest suffix."""
  ctx = list(row[:length])
  for n in range(max_ngram, min_ngram - 1, -1):
    if length < n:
      continue
    suffix = ctx[length - n:]
    for s in range(length - n - 1, -1, -1):  # latest first
      if ctx[s:s + n] == suffix:
        follow = ctx[s + n:s + n + gamma]
        return follow, len(follow)
  return [], 0


def test_hand_computed_examples():
  context = np.zeros((3, 12), np.int32)
  #               0  1  2  3  4  5  6  7  8
  context[0, :9] = [5, 6, 7, 8, 9, 5, 6, 7, 1]  # no 3/2/1-gram "...7 1"
  context[1, :8] = [5, 6, 7, 8, 9, 5, 6, 7]     # "5 6 7" at 0 -> 8 9 5 6
  context[2, :6] = [4, 4, 4, 4, 4, 4]           # latest "4 4 4" at 2 -> 4
  length = np.array([9, 8, 6], np.int32)
  tokens, num = jax.jit(lambda c, l: ngram_match(
      c, l, gamma=4, max_ngram=3, min_ngram=1))(context, length)
  tokens, num = np.asarray(tokens), np.asarray(num)
  # Row 0: "1" occurs nowhere earlier: nothing proposed.
  assert num[0] == 0
  assert num[1] == 4 and tokens[1].tolist() == [8, 9, 5, 6]
  # Row 2: the latest earlier "4 4 4" starts at 2; only "4" follows it.
  assert num[2] == 1 and tokens[2, 0] == 4


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  batch, size, gamma = 8, 40, 5
  vocab = 3 + seed  # small vocabularies repeat n-grams often
  context = rng.integers(0, vocab, (batch, size)).astype(np.int32)
  length = rng.integers(1, size, batch).astype(np.int32)
  for max_ngram, min_ngram in ((3, 1), (4, 2), (2, 2)):
    tokens, num = ngram_match(context, length, gamma=gamma,
                              max_ngram=max_ngram, min_ngram=min_ngram)
    for b in range(batch):
      want, n = _reference(context[b], length[b], gamma, max_ngram,
                           min_ngram)
      assert int(num[b]) == n, (b, max_ngram, min_ngram)
      assert np.asarray(tokens[b, :n]).tolist() == want


def test_invalid_ngram_sizes():
  with pytest.raises(ValueError, match="min_ngram >= 1"):
    PromptLookup(vocab_size=10, max_ngram=3, min_ngram=0)
  with pytest.raises(ValueError, match="max_ngram >= min_ngram"):
    PromptLookup(vocab_size=10, max_ngram=1, min_ngram=2)


# ---------------------------------------------------------------------------
# Through the engine: greedy output equals autoregressive decoding.


def _repetitive_prompts():
  rng = np.random.default_rng(0)
  motif = [7, 8, 9, 10, 11]
  return [
      motif * 3 + [7, 8],                       # repeats: long proposals
      [3, 4, 5] + motif + [3, 4, 5, 7],         # a 3-gram match
      list(rng.integers(12, 100, 9)),           # likely no repeated n-gram
      [42],                                     # one token: nothing to match
  ]


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
@pytest.mark.parametrize("gamma", [
    pytest.param(1, marks=pytest.mark.extended), 3,
    pytest.param(6, marks=pytest.mark.extended)])
def test_greedy_lookup_equals_generate(gamma):
  from specjax import decode, testing  # pylint: disable=g-import-not-at-top
  target, _ = testing.tiny_pair(seed=2)
  prompts = _repetitive_prompts()
  lookup = PromptLookup(vocab_size=target.vocab_size)
  ref = decode.generate(target, prompts, max_new_tokens=20)
  out = decode.speculative_generate(target, lookup, prompts, gamma=gamma,
                                    max_new_tokens=20)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  assert int(out.stats.draft_forwards.sum()) == 0  # no model runs at all
  # A greedy random model repeats itself, so lookup proposes and some
  # proposals are accepted.
  assert int(np.sum(out.stats.proposed_by_position)) > 0
  assert int(np.sum(out.stats.accepted_by_position)) > 0


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_greedy_lookup_with_eos_inside_a_block():
  from specjax import decode, testing  # pylint: disable=g-import-not-at-top
  target, _ = testing.tiny_pair(seed=2)
  prompts = _repetitive_prompts()
  ref = decode.generate(target, prompts, max_new_tokens=20)
  # Stop on a token that greedy decoding emits mid-way in row 0.
  eos = int(ref.tokens[0, 5])
  ref = decode.generate(target, prompts, max_new_tokens=20, eos_id=eos)
  out = decode.speculative_generate(
      target, PromptLookup(vocab_size=target.vocab_size), prompts, gamma=4,
      max_new_tokens=20, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  assert out.lengths[0] <= 6
