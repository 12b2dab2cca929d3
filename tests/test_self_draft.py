"""Self-speculation (`drafters.EarlyExit`, `models.LayerSubset`).

A layer subset is checked against an independent reference: a separate
`Model` built from the kept layers' parameters alone. Drafting with it is
checked against autoregressive decoding of the target (greedy) here, and
against the enumerated exact distribution in `tests/test_distribution.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode
from specjax import drafters
from specjax import models
from specjax import testing

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 24
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def target():
  return models.init_random(testing.TINY_TARGET.replace(num_layers=NUM_LAYERS),
                            jax.random.key(3))


def _kept_model(target, kept):
  """A standalone model of the layers `kept`, renumbered 0.. (no seam)."""
  params = {k: v for k, v in target.params.items()
            if not k.startswith("layers_")}
  params.update({f"layers_{j}": target.params[f"layers_{i}"]
                 for j, i in enumerate(kept)})
  return models.Model(config=target.config.replace(num_layers=len(kept)),
                      params=params)


@pytest.mark.parametrize("exit_layer, skip, kept", [
    (2, (), (0, 1)),
    (None, (1, 2), (0, 3)),
    (3, (0,), (1, 2)),
])
def test_subset_equals_a_model_of_the_kept_layers(target, exit_layer, skip,
                                                  kept):
  subset = models.LayerSubset.create(target, exit_layer=exit_layer, skip=skip)
  reference = _kept_model(target, kept)
  tokens = jnp.array([[5, 17, 99, 3, 8, 1], [42, 7, 7, 2, 0, 0]])
  lengths = jnp.array([6, 4])
  # Prefill, then a two-token chunk at each row's length.
  got_last, got_cache = subset.prefill(tokens, lengths,
                                       subset.init_cache(2, 16))
  want_last, want_cache = reference.prefill(tokens, lengths,
                                            reference.init_cache(2, 16))
  np.testing.assert_allclose(got_last, want_last, rtol=1e-5, atol=1e-5)
  step = jnp.array([[9, 4], [1, 2]])
  got, _ = subset(step, got_cache)
  want, _ = reference(step, want_cache)
  np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
  assert got.logits.shape == (2, 2, target.vocab_size)


def test_shares_the_targets_parameters(target):
  drafter = drafters.EarlyExit(target, 2)
  for mine, theirs in zip(jax.tree.leaves(drafter.model.model.params),
                          jax.tree.leaves(target.params)):
    assert mine is theirs
  assert drafter.model.init_cache(1, 8).k.shape[0] == 2


# Over 15 s each on a 2-core CPU: an early exit and a layer skip run in
# the slow step, the other two with `-m extended`.
@pytest.mark.slow
@pytest.mark.parametrize("exit_layer, skip", [
    (1, ()), pytest.param(3, (), marks=pytest.mark.extended),
    pytest.param(None, (1,), marks=pytest.mark.extended), (3, (0, 2))])
def test_greedy_equals_autoregressive(target, exit_layer, skip):
  baseline = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  out = decode.speculative_generate(
      target, drafters.EarlyExit(target, exit_layer, skip=skip), PROMPTS,
      gamma=3, max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  assert np.all(out.stats.proposed_by_position > 0)


def test_errors_name_the_problem(target):
  for bad in (0, NUM_LAYERS, 7, 1.5):
    with pytest.raises(ValueError, match=r"exit_layer must be an integer in "
                       r"\[1, 4\)"):
      drafters.EarlyExit(target, bad)
  with pytest.raises(ValueError, match=r"layers \[2\] outside the 2 layers"):
    drafters.EarlyExit(target, 2, skip=(0, 2))
  with pytest.raises(ValueError, match="no layer to run"):
    drafters.EarlyExit(target, 2, skip=(0, 1))
