"""`specjax.policies.simulate`: a policy priced by the cost model."""

from __future__ import annotations

import numpy as np
import pytest

from specjax import policies
from specjax.policies import simulate as sim
from specjax.policies.costs import ForwardCosts

G = 4
# Widths 1, 2, 3, 5; a first draft token dearer than the next ones, so a
# simulator that priced drafting as γ equal forwards would be off by 10%.
COSTS = policies.StepCosts(
      max_gamma=G, target_ms=(100.0, 120.0, 130.0, 160.0),
                           draft_ms=10.0, first_draft_ms=40.0)


def fixed(gamma):
  """A fixed γ (None: autoregressive decoding)."""
  return policies.Fixed(gamma) if gamma else None


def make_auto(costs, **kwargs):
  return policies.Auto.from_costs(costs, **kwargs)


def test_autoregressive_costs_one_forward_per_token():
  rate = sim.simulate(fixed(0), COSTS, alpha=0.9, batch=3,
                      tokens=20, samples=4)
  assert rate == pytest.approx(3 / 0.100, rel=1e-6)


@pytest.mark.parametrize("gamma,alpha", [(2, 0.6), (4, (0.9, 0.8, 0.5,
                                                         0.3))])
def test_a_fixed_gamma_matches_the_cost_models_prediction(gamma, alpha):
  """One long row, so that its end (drafts past the last token) weighs
  little, and no row waits for a slower one (which the per-step
  prediction does not price): the mean rate is `StepCosts.tokens_per_s`
  with the same costs."""
  acceptance = [alpha] * G if isinstance(alpha, float) else list(alpha)
  target = ForwardCosts(1, dict(zip((1, 2, 3, 5), COSTS.target_ms)))
  draft = ForwardCosts(1, {1: COSTS.draft_ms, 2: COSTS.first_draft_ms})
  expected = policies.StepCosts.for_fixed(
      gamma, target, draft).tokens_per_s(acceptance, gamma)
  got = sim.simulate(fixed(gamma), COSTS, alpha=alpha, batch=1,
                     tokens=3000, samples=32)
  assert got == pytest.approx(expected, rel=0.005)


@pytest.mark.parametrize("gamma,alpha", [(2, 0.7), (4, 0.9)])
def test_a_batch_waits_for_its_slowest_row_as_predicted(gamma, alpha):
  """Eight rows of 24 tokens: the simulated generation ends with its
  slowest row, 20-30% below the steady-state rate, and the cost model's
  `StepCosts.tokens_per_s(..., tokens=24)` (an exact computation, apart
  from this Monte Carlo) prices that."""
  target = ForwardCosts(8, dict(zip((1, 2, 3, 5), COSTS.target_ms)))
  draft = ForwardCosts(8, {1: COSTS.draft_ms, 2: COSTS.first_draft_ms})
  got = sim.simulate(fixed(gamma), COSTS, alpha=alpha, batch=8,
                     tokens=24, samples=2048)
  costs = policies.StepCosts.for_fixed(gamma, target, draft)
  steady = costs.tokens_per_s([alpha] * G, gamma, batch=8)
  assert got < 0.85 * steady
  assert got == pytest.approx(costs.tokens_per_s([alpha] * G, gamma, batch=8,
                                                 tokens=24), rel=0.01)


def test_auto_stops_drafting_where_nothing_is_accepted():
  """At α = 0 `Auto` pays its probes and then decodes plainly: close to
  autoregressive, far above γ = 1."""
  auto = make_auto(COSTS)
  plain = sim.simulate(fixed(0), COSTS, alpha=0.0, batch=1,
                       tokens=200, samples=8)
  one = sim.simulate(fixed(1), COSTS, alpha=0.0, batch=1,
                     tokens=200, samples=8)
  got = sim.simulate(auto, COSTS, alpha=0.0, batch=1, tokens=200, samples=8)
  assert one < 0.7 * plain
  assert 0.95 * plain < got < plain


@pytest.mark.parametrize("costs, alpha, match", [
    (policies.StepCosts(
      max_gamma=G, target_ms=(1.0, 2.0)), 0.5,
     "one time per width"),
    (COSTS, (0.5, 0.5), "one probability or 4"),
    (COSTS, 1.5, "one probability or 4"),
])
def test_bad_input_is_named(costs, alpha, match):
  with pytest.raises(ValueError, match=match):
    sim.simulate(fixed(1), costs, alpha=alpha, batch=1, tokens=4)


def test_over_best_compares_with_the_best_fixed_gamma_in_hindsight():
  # Every draft accepted on COSTS: γ = 4 emits 5 tokens for 160 + 40 + 3 x
  # 10 ms, the best of γ = 0..4; γ = 1 emits 2 for 120 + 40. Each ratio
  # is γ = 1's over γ = 4's tokens/s on a row whose length both divide.
  run = lambda g, gammas=None: sim.over_best(
      fixed(g), COSTS, alpha=1.0, batch=1, tokens=10, gammas=gammas,
      samples=4)
  np.testing.assert_allclose(run(1), (2 / 160) / (5 / 230), rtol=1e-5)
  np.testing.assert_allclose(run(4), 1.0, rtol=1e-6)
  np.testing.assert_allclose(run(1, gammas=(0, 1)), 1.0, rtol=1e-6)


def test_a_policy_past_the_costs_max_gamma_is_refused():
  with pytest.raises(ValueError, match="does not fit costs of max_gamma=4"):
    sim.simulate(fixed(G + 1), COSTS, alpha=0.5, batch=1, tokens=4)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
@pytest.mark.parametrize("alpha", [0.05, 0.5, 0.8, 0.95])
def test_auto_on_machine_f_costs_is_within_5_percent_of_the_best(alpha):
  """The B = 1 costs machine F cached in its third session, at the
  1.5B/0.5B shapes, and 32 tokens. In expectation over the draws, `Auto`
  from its prior reaches 0.95x the best of autoregressive decoding and
  every fixed γ, knowing neither α nor which γ wins in advance. A guard
  against a policy change that loses on these costs. On a table 10% off
  it does not hold on every machine's costs (BENCHMARKS, "Never slower")."""
  costs = policies.StepCosts(
      max_gamma=G, target_ms=(230.3, 341.9, 327.6, 386.6),
      draft_ms=90.9, first_draft_ms=105.5)
  auto = make_auto(costs)
  assert sim.over_best(auto, costs, alpha=alpha, batch=1,
                       tokens=32) >= 0.95


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_optimism_keeps_drafting_through_unlucky_rejections():
  """Machine F's B = 1 costs where verification was cheap (its fourth
  session, t(3) / t(1) = 1.2), α = 0.8, 32 tokens: γ = 2 is 1.23x
  autoregressive decoding, and early in a generation, while the estimate
  rests on a few observations, two rejections in a row bring it under the
  break-even (0.85 to 0.41, against 0.553). Without the confidence bound
  the policy then waits 16 plain steps, half the row (0.91x the best in
  expectation); with it, it probes at once and stays within 5% (0.97x)."""
  costs = policies.StepCosts(
      max_gamma=G, target_ms=(275.0, 318.0, 331.0, 403.0),
                       draft_ms=92.0, first_draft_ms=109.0)
  ratio = lambda optimism: sim.over_best(
      make_auto(costs, optimism=optimism), costs, alpha=0.8,
      batch=1, tokens=32)
  assert ratio(0.0) < 0.93
  assert ratio(1.0) >= 0.95


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_near_the_end_auto_waits_for_the_slowest_row():
  """Machine G's B = 16 costs (its second session; the two-token pass
  dearer than the three-token one), α = 0.8, 32 tokens: two drafts are
  1.09x a plain step in the steady state, while a 32-token batch of 16
  rows waits for its slowest row and autoregressive decoding is best.
  Chosen by the steady state, `auto` drafts and loses (about 0.90x, warm
  or cold); chosen by when the batch ends (`horizon`), it stays within
  5%."""
  costs = policies.StepCosts(
      max_gamma=G, target_ms=(579.0, 957.0, 869.0, 1204.0),
                       draft_ms=183.9, first_draft_ms=312.0)

  def ratio(horizon):
    auto = make_auto(costs, horizon=horizon)
    return [sim.over_best(p, costs, alpha=0.8, batch=16, tokens=32,
                          samples=128)
            for p in (auto, sim.settled(auto, 0.8))]

  assert max(ratio(0)) < 0.93
  assert min(ratio(32)) >= 0.95


def test_settled_starts_from_steady_counts():
  # rate 0.05: 20 decayed observations per position, 0.8 of them accepted.
  auto = sim.settled(make_auto(COSTS), 0.8)
  state = auto.init(2)
  np.testing.assert_allclose(state.verified, np.full((2, G), 20.0))
  np.testing.assert_allclose(auto.acceptance(state)[0, 0], 0.8, rtol=1e-6)
  assert int(state.wait) == int(auto.probe_every)


def test_settled_takes_one_acceptance_per_position():
  # Position 1 at its own 0.4; position 2 its 20 observations at 0.9 and
  # position 1's estimate as one more: (18 + 0.4) / 21.
  auto = sim.settled(make_auto(COSTS), (0.4, 0.9, 0.9, 0.9))
  estimates = auto.acceptance(auto.init(1))[0]
  np.testing.assert_allclose(estimates[:2], [0.4, 18.4 / 21], rtol=1e-6)
  with pytest.raises(ValueError, match="alpha must be one probability"):
    sim.settled(make_auto(COSTS), (0.4, 0.9))


@pytest.mark.slow  # simulates generations cold and warm at several costs
def test_a_warm_start_follows_the_generation_before_it():
  """Nothing accepted, no observation at prefill. A cold start drafts at
  its first step by its prior (two drafts, 40 + 10 ms, and a 130 ms
  three-token pass: 20 tokens in 2080 ms, not 2000). Started warm from the
  state one such generation ended with, it knows that nothing is accepted
  and its first probe is not due within 20 tokens: exactly
  autoregressive decoding."""
  auto = make_auto(COSTS)
  rate = lambda policy, **kw: sim.simulate(
      policy, COSTS, alpha=0.0, batch=2, tokens=20, samples=8,
      observe_first=False, **kw)
  plain = rate(fixed(0))
  assert rate(auto) == pytest.approx(plain * 2000 / 2080, rel=1e-6)
  assert rate(auto, warm_after=1) == pytest.approx(plain, rel=1e-6)
  with pytest.raises(ValueError, match="warm_after"):
    rate(auto, warm_after=-1)
