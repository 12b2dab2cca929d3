"""Fallback and Cascade drafters: exact greedy output, caches in step with
the committed text, and clear errors.

The reference is `generate` on the target alone.
"""

import numpy as np
import pytest

from specjax import decode
from specjax import drafters
from specjax import testing
from tests.test_drafter_protocol import _check_track_in_sync
from tests.test_drafter_protocol import _perturbed_draft
from tests.test_drafter_protocol import _run_steps

# A row that repeats itself (lookup drafts), one with no repeated n-gram
# (the model drafts), and a short one: rows take different drafters in the
# same step.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 14, 15, 16, 17], [42]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def models():
  target, small = testing.tiny_pair(seed=0)
  return target, _perturbed_draft(target), small


def _drafters(models):
  target, middle, small = models
  v = target.vocab_size
  lookup = drafters.PromptLookup(v, max_ngram=3, min_ngram=1)
  return {
      "fallback": drafters.Fallback(lookup, drafters.DraftModel(middle)),
      "cascade": drafters.Cascade(middle, lookup, 2),
      "cascade2": drafters.Cascade(
          middle, drafters.Cascade(small, drafters.PromptLookup(v), 2), 3),
  }


# Whole generations, each compiling its own loop: the slow step (the
# step-level tests in test_step_distribution cover both drafters' laws).
# CI runs the fallback and the two-level cascade at γ = 3; the rest are
# `-m extended`.
_EXT = pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("kind, gamma", [
    pytest.param("cascade", 1, marks=_EXT),
    pytest.param("fallback", 1, marks=_EXT),
    pytest.param("cascade2", 1, marks=_EXT), ("fallback", 3),
    pytest.param("cascade", 3, marks=_EXT), ("cascade2", 3),
    pytest.param("fallback", 6, marks=_EXT),
    pytest.param("cascade", 6, marks=_EXT),
    pytest.param("cascade2", 6, marks=_EXT)])
def test_greedy_equals_autoregressive(models, kind, gamma):
  drafter = _drafters(models)[kind]
  ref = decode.generate(models[0], PROMPTS, max_new_tokens=MAX_NEW)
  out = decode.speculative_generate(models[0], drafter, PROMPTS, gamma=gamma,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert out.stats.draft_forwards.shape == (len(drafter.components),)
  assert out.stats.accepted_by_position.sum() > 0


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
@pytest.mark.parametrize("kind", [
    pytest.param("fallback", marks=pytest.mark.extended), "cascade"])
def test_eos_inside_a_block(models, kind):
  target = models[0]
  ref = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  eos = ref.row(1)[7]
  want = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_id=eos)
  assert want.lengths[1] <= 8
  out = decode.speculative_generate(target, _drafters(models)[kind], PROMPTS,
                                    gamma=4, max_new_tokens=MAX_NEW,
                                    eos_id=eos)
  np.testing.assert_array_equal(out.tokens, want.tokens)
  np.testing.assert_array_equal(out.lengths, want.lengths)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_fallback_uses_lookup_where_it_matches(models):
  target, middle, _ = models
  lookup = drafters.PromptLookup(target.vocab_size)
  fallback = drafters.Fallback(lookup, drafters.DraftModel(middle))
  out = decode.speculative_generate(target, fallback, [PROMPTS[0]], gamma=3,
                                    max_new_tokens=MAX_NEW)
  alone = decode.speculative_generate(target, middle, [PROMPTS[0]], gamma=3,
                                      max_new_tokens=MAX_NEW)
  lookup_fwd, model_fwd = out.stats.draft_forwards
  assert lookup_fwd == 0
  assert model_fwd < alone.stats.draft_forwards.sum()  # steps it sat out


# Each case takes one to two minutes on a 2-core CPU: the fallback runs in
# the slow step, the two-level cascade with `-m extended`.
@pytest.mark.slow
@pytest.mark.parametrize("kind", [
    "fallback", pytest.param("cascade2", marks=pytest.mark.extended)])
def test_model_caches_stay_in_sync(models, kind):
  target, middle, small = models
  drafter = _drafters(models)[kind]
  seen = []

  def tracks(ds):
    if kind == "fallback":
      return [(ds.second, middle)]
    inner = ds.inner  # the nested cascade: its own track, of `small`
    return [(ds.track, middle), (inner.track, small)]

  def check(state, prompts, lengths):
    for track, model in tracks(state.drafter_state):
      for b in range(len(PROMPTS)):
        if not bool(state.done[b]):
          seen.append(_check_track_in_sync(track, state, prompts, lengths,
                                           model, b))

  _run_steps(target, drafter, PROMPTS, 3, MAX_NEW, check)
  assert seen and max(seen) > 1  # some catch-up of several tokens happened


def test_errors_name_the_problem(models):
  target, middle, _ = models
  with pytest.raises(ValueError, match="vocabularies differ"):
    drafters.Cascade(middle, drafters.PromptLookup(7), 2)
  with pytest.raises(ValueError, match="gamma must be an integer"):
    drafters.Cascade(middle, drafters.PromptLookup(target.vocab_size), 0)
  with pytest.raises(ValueError, match="vocabularies differ"):
    drafters.Fallback(drafters.PromptLookup(7), drafters.DraftModel(middle))
  cascade = drafters.Cascade(middle, drafters.PromptLookup(target.vocab_size),
                             8)
  # 10 prompt tokens + 20 new + gamma + 1 fit in 40; the inner gamma does not.
  with pytest.raises(ValueError, match="Cascade's inner gamma"):
    decode.speculative_generate(target, cascade, [PROMPTS[0]], gamma=4,
                                max_new_tokens=20, cache_size=40)
