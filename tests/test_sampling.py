"""Logit processing against hand-computed and numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))


def _probs(**kw):
  params = sampling.SamplingParams.create(**kw)
  return np.asarray(sampling.probabilities(jnp.asarray(LOGITS), params))


def test_greedy_is_one_hot_argmax():
  np.testing.assert_array_equal(_probs(temperature=0.0), [1, 0, 0, 0, 0])


def test_temperature_one_is_softmax():
  np.testing.assert_allclose(_probs(temperature=1.0),
                             [0.5, 0.2, 0.15, 0.1, 0.05], rtol=1e-5)


def test_top_k_keeps_k_renormalised():
  np.testing.assert_allclose(_probs(temperature=1.0, top_k=2),
                             [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], rtol=1e-5)


def test_top_p_smallest_set_with_mass():
  # Mass before each token: 0, .5, .7, .85, .95 -> keep the first three.
  np.testing.assert_allclose(_probs(temperature=1.0, top_p=0.8),
                             [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0],
                             rtol=1e-5)


def test_top_k_then_top_p():
  # Top-2 renormalised: .714, .286; top_p .6 keeps only the first.
  np.testing.assert_allclose(_probs(temperature=1.0, top_k=2, top_p=0.6),
                             [1, 0, 0, 0, 0], rtol=1e-5)


def test_temperature_sharpens():
  p = np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
  np.testing.assert_allclose(_probs(temperature=0.5), p / p.sum(), rtol=1e-5)


def test_sample_never_draws_zero_probability():
  probs = jnp.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
  draws = jax.vmap(lambda k: sampling.sample(k, probs))(
      jax.random.split(jax.random.key(0), 2000))
  assert set(np.unique(draws[:, 0])) == {1}
  assert set(np.unique(draws[:, 1])) == {0, 2}


@pytest.mark.parametrize("vocab", [5, 128, 300, 1000])
def test_argmax_is_the_first_maximum(vocab):
  # Small integers: many ties, across block boundaries and the padded tail.
  x = np.random.default_rng(vocab).integers(0, 4, (3, 4, vocab))
  x = x.astype(np.float32)
  x[0, 0, -1] = 9.0  # the last token, in the padded block
  x[0, 1, :] = -np.inf
  np.testing.assert_array_equal(sampling.argmax(jnp.asarray(x)),
                                np.argmax(x, axis=-1))


@pytest.mark.parametrize("vocab", [100, 300])  # one block; three, padded
def test_sample_one_hot_returns_its_index_everywhere(vocab):
  draws = sampling.sample(jax.random.key(0), jnp.eye(vocab))
  np.testing.assert_array_equal(draws, np.arange(vocab))


@pytest.mark.parametrize("vocab", [100, 300])  # one block; three, padded
def test_sample_frequencies_match_the_distribution(vocab):
  n = 60000
  probs = np.random.default_rng(0).random(vocab)
  probs[::7] = 0.0
  probs[128:256] = 0.0  # at V = 300, a whole block without mass
  probs /= probs.sum()
  draws = jax.vmap(lambda k: sampling.sample(k, jnp.asarray(probs)))(
      jax.random.split(jax.random.key(1), n))
  counts = np.bincount(np.asarray(draws), minlength=vocab)
  assert counts[probs == 0].sum() == 0
  # Each token's count within 5 binomial standard deviations of n p.
  sd = np.sqrt(n * probs * (1 - probs))
  assert np.all(np.abs(counts - n * probs) <= 5 * sd + 1e-9)


def test_top_probability_is_the_softmax_maximum():
  x = jax.random.normal(jax.random.key(2), (4, 300)) * 5
  np.testing.assert_allclose(sampling.top_probability(x),
                             np.max(jax.nn.softmax(x, axis=-1), axis=-1),
                             rtol=1e-5)


@pytest.mark.parametrize("kw, match", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be a non-negative integer"),
])
def test_invalid_parameters(kw, match):
  with pytest.raises(ValueError, match=match):
    sampling.SamplingParams.create(**kw)
