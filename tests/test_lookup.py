"""Prompt-lookup drafting: the n-gram match against a brute-force reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax.drafters.lookup import ngram_match
from specjax.drafters.lookup import ngram_matches
from specjax.drafters.lookup import PromptLookup


def _reference(row, length, gamma, max_ngram, min_ngram, control=()):
  """Python loops: the latest earlier occurrence of the longest suffix not
  followed by a control token; its continuation up to the first one."""
  ctx = list(row[:length])
  for n in range(max_ngram, min_ngram - 1, -1):
    if length < n:
      continue
    suffix = ctx[length - n:]
    for s in range(length - n - 1, -1, -1):  # latest first
      if ctx[s:s + n] == suffix and ctx[s + n] not in control:
        follow = ctx[s + n:s + n + gamma]
        for i, token in enumerate(follow):
          if token in control:
            follow = follow[:i]
            break
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
  for max_ngram, min_ngram, control in ((3, 1, ()), (4, 2, ()),
                                        (2, 2, ()), (3, 1, (0,)),
                                        (2, 1, (1, 2))):
    tokens, num = ngram_match(context, length, gamma=gamma,
                              max_ngram=max_ngram, min_ngram=min_ngram,
                              control_ids=control)
    for b in range(batch):
      want, n = _reference(context[b], length[b], gamma, max_ngram,
                           min_ngram, control)
      assert int(num[b]) == n, (b, max_ngram, min_ngram, control)
      assert np.asarray(tokens[b, :n]).tolist() == want


def test_a_turns_end_is_no_match():
  # A chat reply that opens a fence (9) after a prompt whose code opened
  # and closed one: the latest earlier 9 is the closing fence, followed by
  # the end of the turn (control 1) and the next turn's header (2, 3).
  # The continuation drafted is the opening fence's (4, 5, 6), and one
  # that reaches a control token stops before it.
  prompt = [7, 9, 4, 5, 6, 9, 1, 2, 3, 9]
  context = np.array([prompt + [0]], np.int32)
  length = np.array([len(prompt)], np.int32)
  match = lambda control: [np.asarray(x)[0].tolist() for x in ngram_match(
      context, length, gamma=4, max_ngram=3, min_ngram=1,
      control_ids=control)]
  assert match(()) == [[1, 2, 3, 9], 4]
  assert match((1, 2)) == [[4, 5, 6, 9], 4]
  # An opening fence whose continuation runs into the turn's end: it
  # stops before the 1.
  context = np.array([[7, 9, 4, 1, 2, 3, 9, 0]], np.int32)
  length = np.array([7], np.int32)
  assert match((1, 2)) == [[4, 1, 2, 3], 1]


def test_tree_candidates_stop_before_control_tokens():
  # ngram_matches (the trie's candidates) by the same rule: the 9 followed
  # by the control token 1 is no candidate; the others' continuations
  # stop before a 1.
  context = np.array([[9, 4, 1, 9, 1, 3, 9, 5, 6, 9]], np.int32)
  tokens, known = ngram_matches(context, np.array([10], np.int32), gamma=3,
                                max_ngram=1, min_ngram=1, count=3,
                                control_ids=(1,))
  got = {tuple(np.asarray(tokens)[0, k, :int(known[0, k])])
         for k in range(3) if known[0, k]}
  assert got == {(5, 6, 9), (4,)}


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
