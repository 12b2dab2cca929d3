"""The rejection sampler on fixed p and q with hand-computed answers."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance
from specjax import rejection


def _one_hot(ids, vocab=4):
  return jax.nn.one_hot(jnp.asarray(ids), vocab)


def test_greedy_accepts_matching_prefix_then_corrects():
  # Row 0: target argmaxes 1, 2, 3 (bonus 0); draft 1, 2, 0 -> 2 accepted, 3.
  # Row 1: draft is wrong at once -> 0 accepted, target's token 2.
  # Row 2: all accepted -> bonus token from the last target position.
  draft = jnp.array([[1, 2, 0], [3, 1, 1], [1, 1, 1]])
  p = _one_hot([[1, 2, 3, 0], [2, 1, 1, 1], [1, 1, 1, 3]])
  n, nxt = rejection.rejection_sample(jax.random.key(0), draft,
                                      _one_hot(draft), p)
  np.testing.assert_array_equal(n, [2, 0, 3])
  np.testing.assert_array_equal(nxt, [3, 2, 3])


def test_unproposed_positions_are_rejected_and_sampled_from_p():
  draft = jnp.array([[1, 2, 3]])
  p = _one_hot([[1, 2, 3, 0]])
  n, nxt = rejection.rejection_sample(jax.random.key(0), draft,
                                      _one_hot(draft), p,
                                      num_drafted=jnp.array([1]))
  np.testing.assert_array_equal(n, [1])
  np.testing.assert_array_equal(nxt, [2])  # p at position 1, not residual


def _run_many(p, q, draft=None, num=40000):
  """Runs the sampler `num` times; draws the draft from q when not given."""
  def one(key):
    draft_key, key = jax.random.split(key)
    d = jax.random.categorical(draft_key, jnp.log(q)) if draft is None else draft
    n, nxt = rejection.rejection_sample(key, d[None], q[None], p[None])
    return d[0], n[0], nxt[0]
  out = jax.vmap(one)(jax.random.split(jax.random.key(1), num))
  return [np.asarray(x) for x in out]


# One draft position, vocab 3.
P = jnp.array([[0.3, 0.5, 0.2], [1 / 3, 1 / 3, 1 / 3]])
Q = jnp.array([[0.6, 0.3, 0.1]])


def test_acceptance_probability_and_residual_are_exact():
  # Draft proposed token 0 with q(0) = .6 while p(0) = .3: accepted with
  # probability .5. Residual max(0, p - q) = (0, .2, .1) -> (0, 2/3, 1/3).
  _, n, nxt = _run_many(P, Q, jnp.array([0]))
  assert abs(n.mean() - 0.5) < 0.01
  freq = np.bincount(nxt[n == 0], minlength=3) / np.sum(n == 0)
  np.testing.assert_allclose(freq, [0.0, 2 / 3, 1 / 3], atol=0.01)


def test_emitted_token_follows_p_when_draft_follows_q():
  # Acceptance sum_x min(p, q) = .3 + .3 + .1 = .7; the emitted token (the
  # accepted draft, else the residual sample) is distributed exactly as p.
  d, n, nxt = _run_many(P, Q)
  assert abs(n.mean() - 0.7) < 0.01
  first = np.where(n == 1, d, nxt)
  np.testing.assert_allclose(np.bincount(first, minlength=3) / first.size,
                             P[0], atol=0.01)


def test_zero_residual_falls_back_to_p():
  # p == q except rounding: a rejection can only come from u*q < p failing by
  # rounding; force it with q(x) > p(x) by 1e-12 and check no NaN and the
  # next token follows p.
  p = jnp.array([[0.5, 0.5], [0.5, 0.5]])
  q = jnp.array([[0.5 + 1e-7, 0.5 - 1e-7]])
  _, n, nxt = _run_many(p, q, jnp.array([0]), num=20000)
  assert np.all((nxt >= 0) & (nxt < 2))
  assert n.mean() > 0.99


def test_q_zero_at_drafted_token_accepts_when_target_allows():
  p = jnp.array([[0.0, 1.0], [1.0, 0.0]])
  q = jnp.array([[1.0, 0.0]])
  n, nxt = rejection.rejection_sample(jax.random.key(0), jnp.array([[1]]),
                                      q[None], p[None])
  np.testing.assert_array_equal(n, [1])
  np.testing.assert_array_equal(nxt, [0])  # bonus from p at position 1


def _drafts(tokens, p, positions, q=None):
  return acceptance.Drafts(tokens=tokens, q=q, p=p, num_drafted=None,
                           positions=positions)


def _synthetic(rate, seed):
  return acceptance.Synthetic(rate=jnp.float32(rate),
                              text=jax.random.key(seed))


def test_synthetic_rate_controls_acceptance():
  p = jnp.full((3, 5), 0.2)
  texts = jax.random.split(jax.random.key(2), 20000)
  n, _ = jax.vmap(lambda text: acceptance.Synthetic(
      rate=jnp.float32(0.7), text=text).judge(jax.random.key(0), _drafts(
          jnp.array([[1, 2]]), p[None], jnp.array([5]))))(texts)
  n = np.asarray(n[:, 0])
  # P(n=0)=.3, P(n=1)=.7*.3, P(n=2)=.49.
  np.testing.assert_allclose(np.bincount(n, minlength=3) / n.size,
                             [0.3, 0.21, 0.49], atol=0.015)


def test_synthetic_verdicts_belong_to_the_text():
  """A position's verdict is the same whichever step judges it: a step
  starting later, or with fewer drafts, reads the same leading run."""
  synthetic = _synthetic(0.6, 3)
  rows, span = 4, 64
  positions = jnp.arange(span)[None] + jnp.array([[0], [7], [7], [100]])
  verdicts = np.asarray(synthetic.accepts(positions))  # [4, 64]
  # Rows 1 and 2 at the same positions: each row has its own text.
  assert (verdicts[1] != verdicts[2]).any()
  assert 0.45 < verdicts.mean() < 0.75
  p = jnp.full((rows, 5, 3), 1 / 3)
  for start in range(0, span - 4, 5):
    for gamma in (1, 2, 4):
      n, _ = synthetic.judge(jax.random.key(start), _drafts(
          jnp.zeros((rows, gamma), jnp.int32), p[:, :gamma + 1],
          positions[:, start]))
      run = np.cumprod(verdicts[:, start:start + gamma], axis=1).sum(1)
      np.testing.assert_array_equal(n, run)
  # Another text gives other verdicts.
  assert (np.asarray(_synthetic(0.6, 4).accepts(positions))
          != verdicts).any()
