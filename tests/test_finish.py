"""`specjax.finish`: the batch's expected steps, checked independently.

Rows drawn alike are checked against `policies.costs.expected_steps` (host,
numpy, itself checked by enumeration); rows that differ in acceptance and
tokens left against a recursion over a row's tokens left, written here.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import finish
from specjax.policies.costs import expected_steps


def test_emit_probabilities_by_hand():
  # a = (0.5, 0.4): P(τ = 1, 2, 3) is (1, 0, 0) for K = 0, (0.5, 0.5, 0)
  # for K = 1, (0.5, 0.3, 0.2) for K = 2.
  emit = finish.emit_probabilities(jnp.array([[0.5, 0.4]]))
  np.testing.assert_allclose(emit[0], [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0],
                                       [0.5, 0.3, 0.2]], rtol=1e-6)


@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("acceptance, tokens, batch", [
    ([0.8, 0.7, 0.6, 0.5], 31, 8), ([0.95] * 4, 12, 16),
    ([0.3, 0.9, 0.2, 0.6], 7, 1), ([0.5] * 4, 20, 32)])
def test_rows_alike_match_the_host_computation(acceptance, tokens, batch,
                                                serial):
  emit = finish.emit_probabilities(jnp.tile(jnp.array(acceptance),
                                            (batch, 1)))
  steps = finish.expected_steps(emit, jnp.full((batch,), tokens),
                                jnp.ones((batch,), bool), horizon=32,
                                serial=serial)
  np.testing.assert_allclose(
      steps, [expected_steps(acceptance, k, tokens, batch)
              for k in range(5)], rtol=1e-5)
  # One distribution for all rows gives the same.
  shared = finish.expected_steps(emit[:1], jnp.full((batch,), tokens),
                                 jnp.ones((batch,), bool), horizon=32,
                                 serial=serial)
  np.testing.assert_allclose(shared, steps, rtol=1e-6)


def _steps_pmf(emit: tuple[float, ...], left: int) -> dict[int, float]:
  """P(a row with `left` tokens needs s steps), by recursion on `left`."""

  @functools.cache
  def pmf(left):
    if left <= 0:
      return {0: 1.0}
    out = {}
    for i, p in enumerate(emit):
      for s, q in pmf(left - i - 1).items():
        out[s + 1] = out.get(s + 1, 0.0) + p * q
    return out

  return pmf(left)


@pytest.mark.parametrize("serial", [True, False])
def test_rows_that_differ_match_a_recursion_on_tokens_left(serial):
  acceptance = np.array([[0.9, 0.6], [0.2, 0.5], [0.7, 0.7]])
  remaining = np.array([5, 3, 9])
  active = np.array([True, True, False])  # the third row is done
  emit = finish.emit_probabilities(jnp.asarray(acceptance))  # [B, 3, 3]
  steps = finish.expected_steps(emit, jnp.asarray(remaining),
                                jnp.asarray(active), horizon=16,
                                serial=serial)
  for k in range(3):
    cdfs = []
    for b in np.flatnonzero(active):
      pmf = _steps_pmf(tuple(np.asarray(emit[b, k], np.float64)),
                       int(remaining[b]))
      cdfs.append(lambda s, pmf=pmf: sum(p for n, p in pmf.items()
                                         if n <= s))
    # Each step emits a token at least, so no row needs over 5 steps.
    expected = sum(1.0 - np.prod([cdf(s) for cdf in cdfs])
                   for s in range(6))
    np.testing.assert_allclose(steps[k], expected, rtol=1e-5)
  # A row past the horizon counts as done at the horizon.
  clipped = finish.expected_steps(emit, jnp.array([5, 3, 40]),
                                  jnp.ones(3, bool), horizon=9, serial=serial)
  np.testing.assert_allclose(
      clipped, finish.expected_steps(emit, jnp.array([5, 3, 9]),
                                     jnp.ones(3, bool), horizon=9,
                                     serial=serial),
      rtol=1e-6)


@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("tokens, horizon", [(64, 64), (3, 3), (2, 5)])
def test_horizons_from_the_default_to_shorter_than_a_step(tokens, horizon,
                                                          serial):
  # horizon 3 < G + 1 = 5: the widest step's distribution is truncated.
  acceptance = [0.9, 0.8, 0.7, 0.6]
  emit = finish.emit_probabilities(jnp.array([acceptance]))  # [1, 5, 5]
  steps = finish.expected_steps(emit, jnp.full((4,), tokens),
                                jnp.ones((4,), bool), horizon=horizon,
                                serial=serial)
  np.testing.assert_allclose(
      steps, [expected_steps(acceptance, k, tokens, 4)
              for k in range(5)], rtol=1e-5)
