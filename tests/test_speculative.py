"""speculative_generate equals generate under greedy decoding, and its stats.

Every expectation comes from an independent computation: autoregressive
`generate` on the same target, or hand-built fixed-logit models.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance
from specjax import decode
from specjax import metrics
from specjax import models
from specjax import testing

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 13  # not a multiple of gamma + 1 for any gamma below


@pytest.mark.parametrize("gamma", [
    1, pytest.param(2, marks=(pytest.mark.slow, pytest.mark.extended)), 4,
    pytest.param(7, marks=(pytest.mark.slow, pytest.mark.extended))])
def test_greedy_equals_autoregressive(pair, baseline, gamma):
  target, draft = pair
  out = decode.speculative_generate(target, draft, PROMPTS, gamma=gamma,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  np.testing.assert_array_equal(out.lengths, baseline.lengths)
  assert out.stats.proposed_by_position.shape == (gamma,)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
@pytest.mark.extended
def test_greedy_equality_other_sizes_and_seeds():
  # A different seed, and a draft with more layers than heads of the target.
  target = models.init_random(
      testing.TINY_TARGET.replace(num_layers=3, vocab_size=96),
      jax.random.key(11))
  draft = models.init_random(
      testing.TINY_DRAFT.replace(num_layers=2, vocab_size=96),
      jax.random.key(12))
  prompts = [[1, 2, 3, 4, 5, 6, 7], [90, 91]]
  want = decode.generate(target, prompts, max_new_tokens=11)
  got = decode.speculative_generate(target, draft, prompts, gamma=3,
                                    max_new_tokens=11)
  np.testing.assert_array_equal(got.tokens, want.tokens)


@pytest.mark.slow  # bf16 matmuls are slow on XLA CPU
@pytest.mark.extended
def test_greedy_equals_autoregressive_in_bf16():
  # dtype="auto" on a GPU or TPU: weights and caches in bf16; attention
  # logits, softmax and the sampler's probabilities in fp32. A γ + 1 token
  # verification and one-token decoding steps round differently in bf16,
  # yet greedy outputs must still agree token for token.
  target, draft = testing.tiny_pair(seed=0, dtype=jnp.bfloat16)
  assert target.init_cache(1, 8).k.dtype == jnp.bfloat16
  out, _ = target(jnp.ones((1, 2), jnp.int32), target.init_cache(1, 8))
  assert out.logits.dtype == jnp.float32
  want = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  # A random draft (rejections) and the target itself (acceptances: the
  # tokens come out of 5-token verification passes).
  for drafter in (draft, target):
    got = decode.speculative_generate(target, drafter, PROMPTS, gamma=4,
                                      max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
  assert got.stats.accepted_by_position[-1] > 0


def test_identical_draft_accepts_everything(pair, baseline):
  target, _ = pair
  out = decode.speculative_generate(target, target, PROMPTS, gamma=4,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  assert metrics.acceptance_rate(out.stats) == 1.0
  # First token from prefill, then 5 per step: ceil(12 / 5) = 3 steps.
  assert int(out.stats.steps) == 3
  assert metrics.mean_accepted_tokens(out.stats) == 5.0


def test_always_wrong_draft_is_still_exact(pair, baseline):
  target, _ = pair
  unused = sorted(set(range(128)) - set(baseline.tokens.ravel().tolist()))[0]
  table = jnp.full((128, 128), -10.0).at[:, unused].set(10.0)
  out = decode.speculative_generate(target, testing.FixedLogitsModel(table),
                                    PROMPTS, gamma=3, max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  assert metrics.acceptance_rate(out.stats) == 0.0
  assert metrics.mean_accepted_tokens(out.stats) == 1.0


def test_eos_inside_a_drafted_block(pair, baseline):
  target, _ = pair
  row = baseline.row(0)
  eos = row[6]
  first = row.index(eos)
  want = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_id=eos)
  assert want.lengths[0] == first + 1  # the EOS is emitted and counted
  # Self-drafting accepts whole blocks of 4, so the EOS arrives mid-block.
  got = decode.speculative_generate(target, target, PROMPTS, gamma=4,
                                    max_new_tokens=MAX_NEW, eos_id=eos,
                                    pad_id=-1)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  for b in range(len(PROMPTS)):
    assert got.row(b) == want.row(b)
    assert np.all(got.tokens[b, got.lengths[b]:] == -1)


def _cycles_table(draft: bool) -> jnp.ndarray:
  """Target: 0->1->2->0 and 3->4->5->3. Draft: right on the first cycle,
  always wrong on the second (it walks it backwards)."""
  nxt = {0: 1, 1: 2, 2: 0, 3: 4, 4: 5, 5: 3}
  if draft:
    nxt.update({3: 5, 4: 3, 5: 4})
  table = np.full((6, 6), -5.0, np.float32)
  for a, b in nxt.items():
    table[a, b] = 5.0
  return jnp.asarray(table)


def test_rows_keep_their_own_accepted_counts():
  target = testing.FixedLogitsModel(_cycles_table(draft=False))
  draft = testing.FixedLogitsModel(_cycles_table(draft=True))
  out = decode.speculative_generate(target, draft, [[0], [3]], gamma=3,
                                    max_new_tokens=9)
  assert out.row(0) == [1, 2, 0, 1, 2, 0, 1, 2, 0]
  assert out.row(1) == [4, 5, 3, 4, 5, 3, 4, 5, 3]
  acc = out.stats.accepted
  # Row 0 accepts all 3 each step: 1 + 4 + 4 tokens = 2 steps, then done.
  np.testing.assert_array_equal(acc[0, :2], [3, 3])
  assert np.all(acc[0, 2:] == -1)
  # Row 1 never accepts: one token per step, 8 steps.
  np.testing.assert_array_equal(acc[1, :8], [0] * 8)
  assert int(out.stats.steps) == 8


def test_early_stop_threshold_limits_drafting(pair, baseline):
  target, draft = pair
  # The tiny random draft is never more than 100% sure: a threshold of 1
  # proposes only the first token of each block, and output stays exact.
  out = decode.speculative_generate(target, draft, PROMPTS, gamma=4,
                                    max_new_tokens=MAX_NEW,
                                    draft_stop_threshold=1.0)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  np.testing.assert_array_equal(out.stats.proposed_by_position[1:], 0)
  assert out.stats.proposed_by_position[0] > 0


def _markov_pair(vocab=128):
  """Fixed-logit (target, draft): synthetic verdicts ignore both models,
  and these compile in a fraction of a transformer's time."""
  table = jax.random.normal(jax.random.key(0), (vocab, vocab))
  return (testing.FixedLogitsModel(table),
          testing.FixedLogitsModel(0.5 * table))


def test_synthetic_acceptance_reads_one_text_per_key():
  """Every step's verdicts are the text's (`decode.synthetic_text`) at
  the drafts' sequence positions: rebuilt step by step from the prompt
  lengths, for two γ run with one key."""
  target, draft = _markov_pair()
  prompts = [[3, 1, 4], [1], [5, 9]]
  text = acceptance.Synthetic(rate=jnp.float32(0.5),
                              text=decode.synthetic_text(5))
  for gamma in (1, 3):
    out = decode.speculative_generate(target, draft, prompts, gamma=gamma,
                                      max_new_tokens=24, key=5,
                                      synthetic_acceptance=0.5)
    accepted = np.asarray(out.stats.accepted)  # [B, M]
    for row, prompt in enumerate(prompts):
      # The first token sits at len(prompt), the first draft after it.
      position = len(prompt) + 1
      steps = accepted[row][accepted[row] >= 0]
      assert len(steps) > 3
      for count in steps:
        verdicts = text.accepts(jnp.full((len(prompts), 1), position)
                                + jnp.arange(gamma)[None])[row]
        assert count == np.cumprod(np.asarray(verdicts)).sum()
        position += int(count) + 1


def test_synthetic_acceptance_is_labelled_and_follows_the_rate():
  target, draft = _markov_pair()
  out = decode.speculative_generate(target, draft, [[1]] * 16, gamma=4,
                                    max_new_tokens=40,
                                    synthetic_acceptance=1.0)
  assert out.synthetic
  assert metrics.acceptance_rate(out.stats) == 1.0
  out = decode.speculative_generate(target, draft, [[1]] * 16, gamma=4,
                                    max_new_tokens=40,
                                    synthetic_acceptance=0.0)
  assert metrics.acceptance_rate(out.stats) == 0.0
