"""Adaptive γ (`gamma="auto"`, `"heuristic"`): exact, switching, no recompile.

Expectations come from independent computations: autoregressive `generate`
on the same target, the cost model's own `predict_tokens_per_s`, and
transformers' schedule written out by hand.
"""

import json

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import policies
from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import loops
from specjax import speculate
from specjax.drafters.base import Proposal
from specjax import tuning
from specjax.tuning import cost

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 48
GAMMA = 4
# Drafting is cheap and the widest pass costs 1.2 forwards: full
# acceptance pays, no acceptance does not.
COSTS = dict(max_gamma=GAMMA, target_ms=[1.0, 1.05, 1.1, 1.2], draft_ms=0.05)


@flax.struct.dataclass
class _Phases(drafters.Drafter):
  """Drafts with the target itself (always accepted under greedy), except
  while the committed text is `bad_from` to `bad_to` tokens long, where it
  shifts every draft by one token (never accepted). q is shifted with it,
  so the proposal stays a sample from its q."""

  inner: drafters.DraftModel
  bad_from: int = flax.struct.field(pytree_node=False)
  bad_to: int = flax.struct.field(pytree_node=False)

  @property
  def vocab_size(self):
    return self.inner.vocab_size

  components = ("model",)

  def init(self, *args):
    return self.inner.init(*args)

  def commit(self, *args):
    return self.inner.commit(*args)

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    length = state.length  # [B] committed tokens
    proposal, state = self.inner.propose(state, key, params, gamma,
                                         stop_threshold, limit=limit)
    bad = (length >= self.bad_from) & (length < self.bad_to)  # [B]
    tokens = jnp.where(bad[:, None], (proposal.tokens + 1) % self.vocab_size,
                       proposal.tokens)
    q = jnp.where(bad[:, None, None], jnp.roll(proposal.q, 1, axis=-1),
                  proposal.q)
    return proposal.replace(tokens=tokens, q=q), state


def _phases(pair, prompts):
  shortest = min(len(p) for p in prompts)
  return _Phases(drafters.DraftModel(pair[0]), bad_from=shortest + 12,
                 bad_to=shortest + 30)


# The default suite runs each policy with one drafter; the other pairs run
# with the slow tests.
@pytest.mark.parametrize("policy, kind", [
    ("auto", "model"),
    pytest.param("heuristic", "lookup", marks=pytest.mark.slow),
    pytest.param("auto", "lookup", marks=pytest.mark.slow),
    pytest.param("heuristic", "model", marks=pytest.mark.slow),
    pytest.param("auto", "fallback", marks=pytest.mark.slow),
    pytest.param("heuristic", "fallback", marks=pytest.mark.slow),
    pytest.param("auto", "cascade", marks=pytest.mark.slow),
    pytest.param("heuristic", "cascade", marks=pytest.mark.slow)])
def test_greedy_equals_autoregressive(pair, baseline, policy, kind):
  target, draft = pair
  lookup = drafters.PromptLookup(target.vocab_size)
  drafter = {
      "model": drafters.DraftModel(draft), "lookup": lookup,
      "fallback": drafters.Fallback(lookup, drafters.DraftModel(draft)),
      "cascade": drafters.Cascade(draft, lookup, 2)}[kind]
  gamma = (policies.Auto.create(**COSTS) if policy == "auto"
           else policies.Heuristic(GAMMA, initial=2))
  out = decode.speculative_generate(target, drafter, PROMPTS, gamma=gamma,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  np.testing.assert_array_equal(out.lengths, baseline.lengths)
  assert out.policy == policy
  scored = out.stats.scored
  assert np.all((scored >= 0) == (out.stats.accepted >= 0))
  assert scored.max() <= GAMMA


def test_auto_switches_between_autoregressive_and_full_drafts(pair,
                                                              baseline):
  # Full acceptance, then a stretch where every draft is rejected, then
  # full acceptance again: `auto` must draft G (at these costs the prior
  # alone, 0.7, predicts G pays: 3.77 tokens in 1.4 plain steps' time),
  # drop to plain steps, and come back (through its probes), and stay
  # exact throughout.
  target, _ = pair
  policy = policies.Auto.create(**COSTS, rate=0.5, probe_every=4)
  out = decode.speculative_generate(
      target, _phases(pair, PROMPTS), PROMPTS, gamma=policy,
      max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  for scored, accepted in zip(out.stats.scored, out.stats.accepted):
    # Full blocks first, then plain steps, then full blocks accepted again.
    assert list(scored[:2]) == [GAMMA, GAMMA], scored
    assert accepted[0] == GAMMA, accepted
    first_plain = np.argmax(scored == 0)
    assert first_plain > 0 and np.sum(scored == 0) >= 5, scored
    assert np.any(accepted[first_plain:] == GAMMA), (scored, accepted)


# A wide pass dear enough that even certain acceptance loses: K drafts
# emit K + 1 tokens for 1 + 1.5 K plain steps' time (t(K+1) + K * 0.5 with
# t = 2.5, 3.5, 5.5 at K = 1, 2, 4), against 1 token per step.
HOPELESS = dict(max_gamma=GAMMA, target_ms=[1.0, 2.5, 3.5, 5.5],
                draft_ms=0.5)


def test_may_draft_asks_whether_certain_acceptance_would_pay():
  assert policies.Auto.create(**COSTS).may_draft()
  assert not policies.Auto.create(**HOPELESS).may_draft()
  # Free drafts (prompt lookup) pay as soon as a pass of K + 1 tokens
  # costs under K + 1 plain steps (5 tokens for 4.5), not at a tie; the
  # heuristic drafts whatever the costs.
  free = dict(HOPELESS, draft_ms=0.0)
  assert not policies.Auto.create(**free).may_draft()  # 5 tokens for 5.5
  assert policies.Auto.create(
      **dict(free, target_ms=[1.0, 2.5, 3.5, 4.5])).may_draft()
  assert not policies.Auto.create(
      **dict(free, target_ms=[1.0, 2.0, 3.0, 5.0])).may_draft()
  assert policies.Heuristic(GAMMA).may_draft()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_auto_that_can_never_pay_decodes_autoregressively(pair, temperature):
  # Where no acceptance could make drafting pay, `speculative_generate`
  # runs `generate` itself: the same tokens for the same key (sampled
  # too), no draft forward (not even the draft's prefill), every step a
  # plain one in the statistics, and no speculative program compiled.
  from specjax import compilation  # pylint: disable=g-import-not-at-top
  target, draft = pair
  kwargs = dict(max_new_tokens=MAX_NEW, temperature=temperature, key=3,
                eos_id=7)
  ref = decode.generate(target, PROMPTS, **kwargs)
  before = compilation.num_compiled()
  policy = policies.Auto.create(**HOPELESS)
  out = decode.speculative_generate(target, draft, PROMPTS, gamma=policy,
                                    **kwargs)
  assert compilation.num_compiled() == before
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  assert out.policy == "auto" and out.gamma == GAMMA
  stats = out.stats
  assert int(np.sum(stats.draft_forwards)) == 0
  assert int(stats.steps) == int(ref.lengths.max()) - 1
  assert int(stats.target_forwards) == int(stats.steps) + 1
  for length, scored, accepted in zip(ref.lengths, stats.scored,
                                      stats.accepted):
    assert np.all(scored[:length - 1] == 0) and np.all(scored[length - 1:]
                                                       == -1), scored
    np.testing.assert_array_equal(accepted, scored)
  assert int(np.sum(stats.proposed_by_position)) == 0
  # What the policy carries to a next call is what it started from.
  warm = policy.warm(out.policy_state)
  np.testing.assert_allclose(warm.start_accepted, policy.start_accepted)


def test_heuristic_follows_transformers_schedule():
  # Budget 2, +2 after a fully accepted budget, -1 (not below 1) after a
  # rejection, capped at G; rows that drafted nothing keep their budget.
  policy = policies.Heuristic(GAMMA, initial=2)
  proposal = Proposal(tokens=jnp.zeros((3, GAMMA), jnp.int32),
                      num_drafted=jnp.array([2, 2, 0], jnp.int32),
                      num_forwards=jnp.int32(0))
  state = policy.init(3)
  budget = policy.budget(state, jnp.array([True, True, True]))
  np.testing.assert_array_equal(budget, [2, 2, 2])
  state = policy.update(state, budget, proposal, jnp.array([2, 1, 0]),
                        jnp.array([True, True, True]))
  # Row 0 accepted its budget, row 1 did not, row 2 drafted nothing.
  np.testing.assert_array_equal(state.budget, [4, 1, 2])
  state = policy.update(state, jnp.array([4, 1, 2]), proposal.replace(
      num_drafted=jnp.array([4, 1, 2])), jnp.array([4, 0, 2]),
                        jnp.array([True, True, False]))
  np.testing.assert_array_equal(state.budget, [4, 1, 2])


def test_auto_budget_maximises_the_cost_models_prediction():
  # The in-loop choice must agree with `tuning.cost.predict_tokens_per_s`
  # evaluated on the host for each γ, with the width each γ runs at.
  widths = policies.verify_widths(8)
  assert widths == (1, 2, 3, 5, 9)
  target_ms = [100.0, 104.0, 107.0, 118.0, 160.0]
  for acceptance, draft_ms in [(0.9, 5.0), (0.6, 5.0), (0.2, 0.0),
                               (0.97, 0.0), (0.75, 30.0)]:
    # A step's first draft token is a dearer two-token catch-up pass.
    draft = cost.ForwardCosts(batch=2, forward_ms={1: draft_ms,
                                                   2: 1.6 * draft_ms})
    policy = policies.Auto.create(max_gamma=8, target_ms=target_ms,
                                  prior=acceptance,
                                  **policies.Auto.draft_costs(draft))
    # Every position seen at `acceptance`, so nothing caps the budget
    # (`test_a_cold_start_tests_its_prior_at_the_first_step`).
    state = policy.init(2).replace(verified=jnp.ones((2, 8)),
                                   accepted=jnp.full((2, 8), acceptance))
    np.testing.assert_allclose(policy.acceptance(state), acceptance,
                               rtol=1e-6)
    active = jnp.array([True, True])
    budget = int(policy.budget(state, active)[0])
    if draft_ms:
      chosen = budget
    else:
      # Free drafts: draft all, then verify the best prefix of them.
      assert budget == 8
      chosen = int(policy.trim(state, jnp.array([8, 8]), active)[0])

    def predicted(g):
      padded = cost.ForwardCosts(batch=2, forward_ms={
          1: target_ms[0], g + 1: target_ms[widths.index(
              next(w for w in widths if w >= g + 1))]})
      return cost.predict_tokens_per_s(
          padded, g, [acceptance] * g, draft if draft_ms else None)

    best = max(range(9), key=predicted)
    assert chosen == best, (acceptance, draft_ms, chosen, best)


def test_auto_trims_to_what_rows_have():
  # After drafting, rows with no draft cost a plain step; with drafts the
  # choice is capped by the longest proposal.
  policy = policies.Auto.create(max_gamma=4, target_ms=[1.0, 1.01, 1.02,
                                                        1.03], prior=0.9)
  state = policy.init(2)
  active = jnp.array([True, True])
  np.testing.assert_array_equal(
      policy.trim(state, jnp.array([0, 0]), active), [0, 0])
  np.testing.assert_array_equal(
      policy.trim(state, jnp.array([2, 1]), active), [2, 2])
  np.testing.assert_array_equal(
      policy.trim(state, jnp.array([4, 0]), active), [4, 4])


def test_auto_drafts_nothing_past_a_rows_end():
  # Full acceptance and cheap passes make G drafts pay, but a row with r
  # tokens left can use only r - 1 of them: the budget and the trim stop
  # there, and a row's last token is a plain step.
  policy = policies.Auto.create(max_gamma=4, target_ms=[1.0, 1.01, 1.02,
                                                        1.03], draft_ms=0.01,
                                prior=1.0)
  # Every position seen accepted (no exploration cap; with a prior of 1,
  # the batch's pooled estimates are 1 as well).
  state = policy.init(2).replace(verified=jnp.ones((2, 4)),
                                 accepted=jnp.ones((2, 4)))
  active = jnp.array([True, True])
  np.testing.assert_array_equal(policy.budget(state, active), [4, 4])
  for left, usable in ((9, 4), (3, 2), (2, 1), (1, 0)):
    remaining = jnp.array([left, left])
    np.testing.assert_array_equal(
        policy.budget(state, active, remaining), [usable] * 2)
    np.testing.assert_array_equal(
        policy.trim(state, jnp.array([4, 4]), active, remaining),
        [usable] * 2)
  # Rows with different ends: the batch takes the longest useful budget.
  np.testing.assert_array_equal(
      policy.budget(state, active, jnp.array([2, 3])), [2, 2])


def test_near_the_end_auto_chooses_by_when_the_batch_ends():
  # Once no row has over `horizon` tokens left, the in-loop choice must
  # agree with `tuning.cost.predict_tokens_per_s(..., tokens=r)` on the
  # host, which waits for the slowest of B rows. Machine G's B = 32 costs
  # (ms; widths 1, 2, 3, 5): at α = 0.5 one draft is 1.06x a plain step
  # in the steady state but not over 31 tokens; at 0.8 it pays both ways.
  target_ms = [1063.5, 1107.4, 1500.4, 2131.2]
  draft = cost.ForwardCosts(batch=32, forward_ms={1: 367.5, 2: 392.9})
  widths = policies.verify_widths(GAMMA)
  batch, left = 32, 31
  active = jnp.ones((batch,), bool)
  chosen = {}
  for acceptance in (0.5, 0.8, 0.95):
    # The batch's end computed in a loop and all at once (`finish`).
    for horizon, serial in ((0, None), (64, True), (64, False)):
      # Every position seen at `acceptance`, over so many steps that the
      # confidence bound hopes for nothing more; no probe due.
      policy = policies.Auto.create(max_gamma=GAMMA, target_ms=target_ms,
                                    horizon=horizon, probe_first=False,
                                    serial_finish=serial,
                                    **policies.Auto.draft_costs(draft))
      state = policy.init(batch).replace(
          verified=jnp.ones((batch, GAMMA)),
          accepted=jnp.full((batch, GAMMA), acceptance),
          seen_verified=jnp.full((batch, GAMMA), 1000.0))
      np.testing.assert_allclose(policy.pooled(state, active)[0],
                                 acceptance, rtol=1e-6)
      chosen[acceptance, horizon, serial] = int(policy.budget(
          state, active, jnp.full((batch,), left))[0])

    def predicted(g, tokens):
      padded = cost.ForwardCosts(batch=batch, forward_ms={
          1: target_ms[0], g + 1: target_ms[widths.index(
              next(w for w in widths if w >= g + 1))]})
      return cost.predict_tokens_per_s(padded, g, [acceptance] * g, draft,
                                       tokens=tokens)

    # A row with r tokens left uses at most r - 1 drafts either way.
    for serial in (True, False):
      assert chosen[acceptance, 64, serial] == max(
          range(GAMMA + 1), key=lambda g: predicted(g, left)), acceptance
    assert chosen[acceptance, 0, None] == max(
        range(GAMMA + 1), key=lambda g: predicted(g, None)), acceptance
  assert chosen[0.5, 0, None] == 1 and chosen[0.5, 64, False] == 0, chosen
  with pytest.raises(ValueError, match="horizon"):
    policies.Auto.create(**COSTS, horizon=-1)
  with pytest.raises(ValueError, match="serial_finish"):
    policies.Auto.create(**COSTS, serial_finish=1)


def test_pooled_estimates_count_the_start_once():
  # Eight rows from a prior of 0.7 (rate 0.2), each accepting a one-token
  # probe: every row's estimate is (0.56 + 1) / (0.8 + 1) = 0.867, but the
  # batch saw eight acceptances and one prior: (8 + 0.56) / (8 + 0.8) =
  # 0.973, with 8 trials. A row that ended still counts what it saw; one
  # that saw nothing does not.
  policy = policies.Auto.create(**COSTS, rate=0.2)
  batch = 8
  active = jnp.ones((batch,), bool)
  proposal = Proposal(tokens=jnp.zeros((batch, GAMMA), jnp.int32),
                      num_drafted=jnp.ones((batch,), jnp.int32),
                      num_forwards=jnp.int32(1))
  ones = jnp.ones((batch,), jnp.int32)
  state = policy.update(policy.init(batch), ones, proposal, ones, active)
  np.testing.assert_allclose(policy.acceptance(state)[:, 0], 1.56 / 1.8,
                             rtol=1e-6)
  pooled, trials = policy.pooled(state, active)
  np.testing.assert_allclose(pooled[0], 8.56 / 8.8, rtol=1e-6)
  assert float(trials[0]) == 8.0
  # Row 0 rejected a second probe: its counts (1.44 + 1, 1.248); the other
  # rows' own counts (1, 1) and the prior's (0.8, 0.56) at their decay;
  # row 0's prior copy is at 0.64, so the prior counts once at the mean
  # decay (0.64 + 7 * 0.8) / 8 = 0.78.
  row0 = jnp.arange(batch) == 0
  state = policy.update(state, ones, proposal, 0 * ones, row0)
  once = (0.64 + 7 * 0.8) / 8
  verified = (2.44 - 0.64) + 7 * 1.0 + once
  accepted = (1.248 - 0.448) + 7 * 1.0 + 0.7 * once
  pooled, trials = policy.pooled(state, active)
  np.testing.assert_allclose(pooled[0], accepted / verified, rtol=1e-5)
  assert float(trials[0]) == 9.0
  pooled, trials = policy.pooled(state, ~row0)
  np.testing.assert_allclose(pooled[0], accepted / verified, rtol=1e-5)
  assert float(trials[0]) == 9.0
  # Row 0 ended before its first probe: only rows 1-7's evidence, and the
  # prior at their decay.
  state = policy.update(policy.init(batch), ones, proposal, ones, ~row0)
  pooled, trials = policy.pooled(state, ~row0)
  np.testing.assert_allclose(pooled[0], (7 + 0.56) / (7 + 0.8), rtol=1e-6)
  assert float(trials[0]) == 7.0


def test_auto_estimates_follow_observed_acceptance():
  # Decayed counts (weight 1 - rate = 0.5 on the past): position 1 starts
  # from the prior as one observation; deeper positions add the estimate
  # before them as one observation. Expected values worked out by hand.
  policy = policies.Auto.create(max_gamma=3,
                                target_ms=[1.0, 1.1, 1.2, 1.3],
                                prior=0.5, rate=0.5)
  state = policy.init(1)
  np.testing.assert_allclose(policy.acceptance(state)[0], [0.5] * 3)
  proposal = Proposal(tokens=jnp.zeros((1, 3), jnp.int32),
                      num_drafted=jnp.array([3]), num_forwards=jnp.int32(3))
  # Positions 1 and 2 accepted, 3 rejected: all three were verified, so
  # verified [1.5, 1, 1], accepted [1.25, 1, 0]. Then the first rejected:
  # positions 2 and 3 were not verified and keep their counts;
  # verified[0] = 0.75 + 1, accepted[0] = 0.625.
  for num_accepted, a1 in ((2, 1.25 / 1.5), (0, 0.625 / 1.75)):
    state = policy.update(state, jnp.array([3]), proposal,
                          jnp.array([num_accepted]), jnp.array([True]))
    a2 = (1 + a1) / 2
    np.testing.assert_allclose(policy.acceptance(state)[0],
                               [a1, a2, a2 / 2], rtol=1e-6)
  assert int(state.idle) == 0


def test_warm_policy_starts_from_pooled_estimates():
  # Two rows that saw different steps: the next generation starts every
  # row from the ratios of all the batch saw (not of its decayed counts,
  # zero here), with the prior it started from: position 1 verified 1 +
  # 4 + 2 times, accepted 0.7 + 4 + 0; position 2 verified 2 times,
  # accepted once. Each row with the counts a row held: the prior's and
  # half the observations, 1 + 3 and 0 + 1.
  policy = policies.Auto.create(max_gamma=2, target_ms=[1.0, 1.1, 1.2],
                                rate=0.2)
  state = policy.init(2).replace(
      seen_verified=jnp.array([[4.0, 2.0], [2.0, 0.0]]),
      seen_accepted=jnp.array([[4.0, 1.0], [0.0, 0.0]]),
      verified=jnp.zeros((2, 2)), accepted=jnp.zeros((2, 2)))
  warmed = policy.warm(state)
  warm = warmed.init(3)
  np.testing.assert_allclose(warm.verified, [[4.0, 1.0]] * 3)
  a1 = 4.7 / 7.0
  np.testing.assert_allclose(policy.acceptance(warm)[0],
                             [a1, (0.5 + a1) / 2], rtol=1e-6)
  # The batch's pool continues the earlier one: the start counts stand
  # for both rows that learned them, 4 + 2 trials (not one row's 3).
  pooled, trials = warmed.pooled(warm, jnp.ones((3,), bool))
  np.testing.assert_allclose(pooled, [a1, (1.0 + a1) / 3], rtol=1e-6)
  assert float(trials[0]) == 6.0
  # A long generation's estimates start with the weight of a steady
  # decayed count, 1 / rate = 5 observations of position 1, so that the
  # next rows' own observations move them.
  long = policy.init(1).replace(seen_verified=jnp.array([[20.0, 10.0]]),
                                seen_accepted=jnp.array([[16.0, 8.0]]))
  start = policy.warm(long)
  np.testing.assert_allclose(start.start_verified, [5.0, 50.0 / 21.0],
                             rtol=1e-6)
  np.testing.assert_allclose(start.start_accepted,
                             [16.7 * 5.0 / 21.0, 40.0 / 21.0], rtol=1e-6)
  heuristic = policies.Heuristic(2)
  assert heuristic.warm(heuristic.init(2)) is heuristic


def test_a_warm_policy_priced_anew_keeps_what_it_learned():
  policy = policies.Auto.create(max_gamma=2, target_ms=[1.0, 1.1, 1.2],
                                draft_ms=0.3, rate=0.2)
  state = policy.init(1).replace(seen_verified=jnp.array([[4.0, 2.0]]),
                                 seen_accepted=jnp.array([[3.0, 1.0]]))
  warm = policy.warm(state)
  priced = warm.priced([2.0, 2.1, 2.5], draft_ms=0.5, first_draft_ms=0.6)
  np.testing.assert_allclose(priced.target_ms, [2.0, 2.1, 2.5])
  assert (float(priced.draft_ms), float(priced.first_draft_ms)) == (
      pytest.approx(0.5), pytest.approx(0.6))
  for name in ("start_verified", "start_accepted", "start_trials",
               "start_rows", "rate", "margin"):
    np.testing.assert_array_equal(getattr(priced, name),
                                  getattr(warm, name))
  with pytest.raises(ValueError, match="target_ms"):
    warm.priced([2.0, 2.1])


def test_a_warm_start_trusts_the_whole_generation_not_its_last_steps():
  # Machine G's B = 1 costs, and a fast decay (rate 0.2: the default's
  # estimate would not fall so far in four steps). A generation whose
  # first 8 four-token steps were accepted and whose last 4 were rejected
  # at their first draft: its decayed estimate of position 1 ends at 0.37,
  # about the last five observations, under which no budget pays; all it
  # saw says (0.7 + 8) / 13 = 0.67, under which four drafts pay. The next
  # generation starts from the latter and drafts at once.
  policy = policies.Auto.create(**G_B1, rate=0.2)
  budgets, state = _steps(policy, lambda step, budget: budget * (step < 8),
                          12)
  assert budgets == [1] + [4] * 11, budgets
  assert float(policy.acceptance(state)[0, 0]) < 0.4
  warm = policy.warm(state)
  np.testing.assert_allclose(warm.acceptance(warm.init(1))[0, 0],
                             8.7 / 13.0, rtol=1e-6)
  assert _steps(warm, lambda step, budget: budget, 3)[0] == [4, 4, 4]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_prefill_observes_the_first_acceptance(pair, temperature):
  # Before any step, each row observes draft position 1 once, for free:
  # the draft model's prefill guessed the token the target drew first.
  # Expected: Σ min(p, q) of the two models' next-token distributions
  # after each prompt, recomputed here by plain forwards (under greedy,
  # whether their argmaxes agree), added to the prior's count decayed by
  # 1 - rate = 0.95.
  target, draft = pair
  policy = policies.Auto.create(**COSTS)
  prompts, lengths, size = decode.prepare_prompts(
      PROMPTS, target.vocab_size, max_new_tokens=8, cache_size=None,
      reserve=GAMMA + 1)
  start = lambda drafter, **kw: loops.init_spec_state(
      target, drafter, jnp.asarray(prompts), jnp.asarray(lengths),
      speculate.StepParams.create(temperature=temperature, **kw),
      jax.random.key(0), policy=policy, max_new_tokens=8, cache_size=size,
      synthetic="synthetic_acceptance" in kw).policy_state

  def next_probs(model, prompt):
    out, _ = model(jnp.asarray([prompt], jnp.int32),
                   model.init_cache(1, size))
    logits = np.asarray(out.logits[0, -1], np.float64)
    if temperature == 0.0:
      return np.eye(len(logits))[np.argmax(logits)]
    return np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()

  # The tiny draft, and the target drafting for itself (always accepted).
  for model in (draft, target):
    seen = np.array([np.minimum(next_probs(target, p),
                                next_probs(model, p)).sum() for p in PROMPTS])
    state = start(drafters.DraftModel(model))
    np.testing.assert_allclose(state.accepted[:, 0], 0.95 * 0.7 + seen,
                               rtol=1e-5)
    np.testing.assert_allclose(state.verified[:, 0], 0.95 + 1.0)
    np.testing.assert_array_equal(state.seen_verified[:, 0], 1.0)
    # The observation replaces the first-step probe.
    assert int(state.wait) == int(policy.probe_every)
  np.testing.assert_allclose(seen, 1.0, rtol=1e-5)
  # Synthetic acceptance draws the observation at its rate.
  for rate in (0.0, 1.0):
    state = start(drafters.DraftModel(draft), synthetic_acceptance=rate)
    np.testing.assert_allclose(state.accepted[:, 0], 0.665 + rate,
                               rtol=1e-6)
  # A drafter whose prefill guesses nothing (prompt lookup) observes
  # nothing and probes at its first step.
  state = start(drafters.PromptLookup(vocab_size=target.vocab_size))
  np.testing.assert_array_equal(state.seen_verified[:, 0], 0.0)
  assert int(state.wait) == 0


def _steps(policy, accept, num_steps, tokens=None):
  """Drives `policy` for one row; `accept(step, budget)` is how many of the
  step's drafts are accepted, `tokens` how many the row has left at the
  first step (None for no end; one fewer at each step). Returns the
  budgets and the last state."""
  active, state, budgets = jnp.array([True]), policy.init(1), []
  for step in range(num_steps):
    remaining = None if tokens is None else jnp.array([tokens - step])
    budget = policy.budget(state, active, remaining)
    proposal = Proposal(tokens=jnp.zeros((1, GAMMA), jnp.int32),
                        num_drafted=budget, num_forwards=budget[0])
    state = policy.update(state, budget, proposal,
                          jnp.minimum(budget, accept(step, budget)), active)
    budgets.append(int(budget[0]))
  return budgets, state


def test_failed_probes_back_off_until_drafting_pays_again():
  # Nothing accepted: plain steps, a probe after 2 idle steps, then 4, then
  # 8, capped at 8; once a probe is accepted the policy drafts of its own
  # accord and the wait returns to 2. (No probe at the first step here:
  # `test_a_cold_start_tests_its_prior_at_the_first_step`.)
  policy = policies.Auto.create(**COSTS, prior=0.0, probe_every=2,
                                probe_max=8, probe_first=False)
  budgets, state = _steps(
      policy, lambda step, budget: budget * (step >= 34), 40)
  probes = [step for step, k in enumerate(budgets[:35]) if k]
  assert probes == [2, 7, 16, 25, 34], probes
  assert int(state.wait) == 2 and int(state.idle) == 0
  # A probe predicted to cost 4.5 plain steps (a 1.0 draft token, one
  # catch-up pass priced 1.0 x 3.0 / 1.0, and 0.5 for the wider target
  # pass) waits 4.5 times as long.
  dear = policies.Auto.create(max_gamma=GAMMA, target_ms=[1.0, 1.5, 2.0, 3.0],
                              draft_ms=1.0, prior=0.0, probe_every=2,
                              probe_first=False)
  np.testing.assert_allclose(dear.probe_ms(jnp.int32(2)), 4.5)
  # By the 9 plain steps that takes, the draft model has fallen 9 tokens
  # behind: two catch-up passes, a price of 7.5. Every step idle adds 3.0
  # / 5 = 0.6 to it, 1.2 plain steps at a wait of 2: a probe could never
  # keep to its share of the time, and none is made.
  np.testing.assert_allclose(dear.probe_ms(jnp.int32(9)), 7.5)
  budgets, _ = _steps(dear, lambda step, budget: 0 * budget, 64)
  assert budgets == [0] * 64, budgets
  # With a first draft token of 1.0, a further one of 0.25 and a wait of
  # 3, the first step i with i >= 3 x price(i), price(i) = 1.0 + ceil(i /
  # 5) x 0.25 x 3.0 + 0.5, is i = 9: by then the draft model needs two
  # catch-up passes. (Priced at the wait, 3 x 2.25, it would have been 7.)
  cheaper = policies.Auto.create(
      max_gamma=GAMMA, target_ms=[1.0, 1.5, 2.0, 3.0], draft_ms=0.25,
      first_draft_ms=1.0, prior=0.0, probe_every=3, probe_first=False)
  price = lambda i: 1.0 + -(-i // 5) * 0.75 + 0.5
  first = next(i for i in range(1, 64) if i >= 3 * max(1.0, price(i)))
  assert first == 9
  budgets, _ = _steps(cheaper, lambda step, budget: 0 * budget, 12)
  assert budgets.index(1) == first, budgets
  with pytest.raises(ValueError, match="probe_max"):
    policies.Auto.create(**COSTS, probe_every=8, probe_max=4)


# Costs measured on machine F at B = 1 (ms; targets at T = 1, 2, 3, 5).
F_B1 = dict(max_gamma=GAMMA, target_ms=[230.0, 342.0, 328.0, 387.0],
            draft_ms=91.0, first_draft_ms=105.0)
# Machine F's at B = 4: even certain acceptance gains 2.6%.
F_B4 = dict(max_gamma=GAMMA, target_ms=[348.0, 526.0, 709.0, 1188.0],
            draft_ms=120.0, first_draft_ms=189.0)
# Machine G's (sixth session, p_b1): verification nearly free.
G_B1 = dict(max_gamma=GAMMA, target_ms=[229.0, 259.0, 275.0, 300.0],
            draft_ms=92.0, first_draft_ms=100.0)


def test_a_cold_start_tests_its_prior_at_the_first_step():
  # Costs where the prior (0.7) predicts that no K pays, but K = 2 and 4
  # pay once position 1 is seen accepted (machine F at B = 1: a draft
  # token 0.4 of a target pass, the two-token pass 1.5x a one-token one).
  # From the prior alone the policy never drafted, so it never learned
  # that drafts are accepted; now its first step drafts one token. (With
  # no evidence, the confidence bound on the prior alone, 0.7 + 0.46,
  # capped at 1, also hopes for a draft where no margin is asked for:
  # `test_an_optimistic_bound_probes_...`. It hopes for one token, 2 in
  # 342 + 105 ms, 4.474 a second against a plain step's 4.348: 2.9% more,
  # under the default margin of 3%, so by default it does not.)
  all_accepted = lambda step, budget: budget
  never = policies.Auto.create(**F_B1, probe_first=False, optimism=0.0)
  assert _steps(never, all_accepted, 12)[0] == [0] * 12
  hoping = policies.Auto.create(**F_B1, probe_first=False, margin=0.0)
  assert _steps(hoping, all_accepted, 3)[0] == [1, 2, 4]
  careful = policies.Auto.create(**F_B1, probe_first=False)
  assert _steps(careful, all_accepted, 3)[0] == [0, 0, 0]
  assert _steps(careful.replace(margin=jnp.float32(0.028)), all_accepted,
                1)[0] == [1]
  # Counts decay by 1 - rate = 0.95. Accepted, every position is estimated
  # at (0.665 + 1) / 1.95 = 0.854, and two drafts pay best: 2.583 tokens
  # in 328 + 105 + 91 = 524 ms (4.929 a second) against four's 3.737 in
  # 387 + 105 + 3 * 91 = 765 ms (4.884) and a plain step's 4.348. Both
  # accepted, position 1 is at 2.582 / 2.853 = 0.905 and the deeper ones
  # at (1 + 0.905) / 2 = 0.953: four drafts, 4.371 tokens in 765 ms
  # (5.713) against two's 2.767 in 524 (5.281).
  budgets, state = _steps(policies.Auto.create(**F_B1), all_accepted, 6)
  assert budgets == [1, 2, 4, 4, 4, 4], budgets
  # Accepted, then the two-token step rejected at its first draft: 1.582 /
  # 2.853 = 0.554 at every position, under which no K beats a plain step
  # (two drafts: 1.862 tokens in 524 ms, 3.553 a second). Its bound 0.554
  # + √(0.554 · 0.446 / 3) = 0.842, the deeper positions at 0.554, puts
  # two drafts first (2.308 tokens in 524 ms, 4.405), 1.3% over a plain
  # step: under the default margin, plain steps. Without a margin it is
  # one more try; rejected again, 1.503 / 3.710 = 0.405 and a bound of
  # 0.405 + 0.245 = 0.650 hope for nothing (two drafts 3.653 a second,
  # one 3.692): plain steps.
  first_only = lambda step, budget: budget * (step == 0)
  budgets, _ = _steps(policies.Auto.create(**F_B1), first_only, 6)
  assert budgets == [1, 2, 0, 0, 0, 0], budgets
  budgets, _ = _steps(policies.Auto.create(**F_B1, margin=0.0), first_only,
                      6)
  assert budgets == [1, 2, 2, 0, 0, 0], budgets
  # Rejected, the first probe leaves plain steps and the usual wait.
  budgets, state = _steps(policies.Auto.create(**F_B1),
                          lambda step, budget: 0 * budget, 8)
  assert budgets == [1] + [0] * 7 and int(state.wait) == 16, budgets
  # Started warm from learned estimates, the first step is no probe.
  warm = policies.Auto.create(**F_B1).warm(state)
  assert _steps(warm, all_accepted, 3)[0] == [0] * 3


# Machine F's B = 1 costs where verification was cheap (its fourth
# session, t(3) / t(1) = 1.2): a one-token draft pays from a position-1
# acceptance of (318 + 109) / 275 - 1 = 0.553.
F_CHEAP = dict(max_gamma=GAMMA, target_ms=[275.0, 318.0, 331.0, 403.0],
               draft_ms=92.0, first_draft_ms=109.0)


def test_an_optimistic_bound_probes_near_the_break_even():
  # Position 1's estimate a = accepted / verified, its bound a + sqrt(a (1
  # - a) / (trials + 1)). a = 0.5 after 2 trials: 0.5 + 0.289 = 0.789 >
  # 0.553, a one-token probe at once (not due: the wait is 16 steps);
  # without optimism a plain step. After 1000 trials: 0.5 + 0.016, plain.
  # a = 0.2 after 2 trials: 0.2 + 0.231 = 0.431, plain.
  policy = policies.Auto.create(**F_CHEAP, probe_first=False)
  plain = policies.Auto.create(**F_CHEAP, probe_first=False, optimism=0.0)
  active = jnp.array([True])

  def budget(policy, a, trials):
    state = policy.init(1).replace(
        verified=jnp.array([[4.0, 0.0, 0.0, 0.0]]),
        accepted=jnp.array([[4.0 * a, 0.0, 0.0, 0.0]]),
        seen_verified=jnp.array([[trials, 0.0, 0.0, 0.0]]))
    return int(policy.budget(state, active)[0])

  assert budget(policy, 0.5, 2.0) == 1
  assert budget(plain, 0.5, 2.0) == 0
  assert budget(policy, 0.5, 1000.0) == 0
  assert budget(policy, 0.2, 2.0) == 0
  # From the prior (0.7: two drafts pay at once on these costs), every
  # draft rejected: a = 0.56 / 1.8 = 0.311 after one trial, bound 0.311 +
  # 0.327 = 0.638, a hoped-for probe; a = 0.448 / 2.44 = 0.184 after two,
  # bound 0.408, plain steps.
  # The trials count every step that verified position 1, undecayed, and
  # a warm start carries them.
  budgets, state = _steps(policy, lambda step, budget: 0 * budget, 4)
  assert budgets == [2, 1, 0, 0], budgets
  assert float(state.seen_verified[0, 0]) == 2.0
  warm = policy.warm(state)
  assert float(warm.pooled(warm.init(2), jnp.ones((2,), bool))[1][0]) == 2.0
  with pytest.raises(ValueError, match="optimism"):
    policies.Auto.create(**F_CHEAP, optimism=-1.0)


def test_a_deeper_position_rejected_early_is_tried_again():
  # F_CHEAP, position 1 accepted (a1 near 1): two drafts beat one by the
  # 3% margin where (1 + a1 + a1 a2) / (331 + 109 + 92) > 1.03 (1 + a1) /
  # (318 + 109), a2 > 0.60 at a1 = 0.9 and 0.53 at 1. Position 2 rejected
  # at the first step: its estimate (0 + a1) / (1 + 1) <= 0.5, one draft a
  # step from then on at the estimates alone (optimism 0), although every
  # later draft would be accepted. Its bound after one verification,
  # 0.45 + sqrt(0.45 * 0.55 / 2) = 0.80 at a1 = 0.9, tries two at once.
  accept_later = lambda step, budget: jnp.where(step == 0, 1, budget)
  budgets, _ = _steps(policies.Auto.create(**F_CHEAP, optimism=0.0),
                      accept_later, 12)
  assert budgets == [2] + [1] * 11, budgets
  budgets, state = _steps(policies.Auto.create(**F_CHEAP), accept_later, 12)
  assert budgets[1] == 2 and min(budgets[1:]) >= 2, budgets
  assert float(state.seen_verified[0, 1]) == 12.0
  # Where position 2 is always rejected, the bound narrows with its
  # verifications (after 3: about 0.27 + sqrt(0.27 * 0.73 / 4) = 0.49)
  # and the policy stops trying it.
  budgets, state = _steps(policies.Auto.create(**F_CHEAP),
                          lambda step, budget: jnp.minimum(budget, 1), 40)
  assert float(state.seen_verified[0, 1]) <= 4.0, budgets
  assert budgets[-30:] == [1] * 30, budgets


def test_a_gain_under_the_margin_is_not_drafted():
  # `choose` takes the best K >= 1 only where it beats K = 0 by more than
  # the margin: 1.025 does not beat 1 by 3%, 1.04 does.
  policy = policies.Auto.create(**F_B1)
  choose = lambda rate, **kw: int(policy.choose(jnp.array(rate), **kw))
  assert choose([1.0, 1.02, 1.025, 0.9, 0.8]) == 0
  assert choose([1.0, 1.02, 1.04, 0.9, 1.035]) == 2
  assert choose([1.0, 1.02, 1.04, 0.9, 1.035], most=1) == 0
  assert int(policy.replace(margin=jnp.float32(0.0)).choose(
      jnp.array([1.0, 1.02, 1.025, 0.9, 0.8]))) == 2
  # Where even certain acceptance gains less (machine F at B = 4, 2.6%:
  # 3 tokens in 709 + 189 + 120 = 1018 ms against 1 in 348), no step can
  # draft, and `speculative_generate` decodes autoregressively.
  assert not policies.Auto.create(**F_B4).may_draft()
  assert policies.Auto.create(**F_B4, margin=0.02).may_draft()
  with pytest.raises(ValueError, match="margin"):
    policies.Auto.create(**F_B1, margin=-0.01)


def test_no_probe_that_the_tokens_left_cannot_repay():
  # Machine F at B = 4: even certain acceptance saves 2.6% of a plain
  # step's time per token (K = 2: 3 tokens in 1018 ms against 1 in 348),
  # 8.7 ms a token, while a probe costs a draft pass and a two-token pass,
  # 367 ms beyond a plain step: it can pay for itself only with over 42
  # tokens left. With the F B = 1 costs (a 217 ms probe; with 4 tokens
  # left, 3 drafts at certain acceptance save 61.5 ms a token, with 3
  # left 2 save 55.3) it can with 4. (No margin here: a 2.6% gain is
  # under the default one, which alone would stop every draft at F's
  # B = 4: `test_a_gain_under_the_margin_is_not_drafted`.)
  accepted = lambda step, budget: budget
  for costs, short, long in ((F_B4, 42, 43), (F_B1, 3, 4)):
    policy = policies.Auto.create(**costs, margin=0.0)
    assert policy.may_draft()
    assert _steps(policy, accepted, 1, tokens=short)[0] == [0]
    assert _steps(policy, accepted, 1, tokens=long)[0] == [1]
  # The periodic probes too: after a rejected first probe the next is due
  # at step 5 (`probe_ms` stretches the wait of 2); with 4 tokens left
  # there it is not made.
  rejected = lambda step, budget: 0 * budget
  no_end, _ = _steps(policies.Auto.create(**F_B1, probe_every=2), rejected,
                     12)
  assert no_end.count(1) == 2, no_end
  assert no_end.index(1, 1) == 5, no_end
  near_end, _ = _steps(policies.Auto.create(**F_B1, probe_every=2),
                       rejected, 9, tokens=9)
  assert near_end == [1] + [0] * 8, near_end


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_low_acceptance_drops_to_autoregressive_steps(pair):
  # Synthetic acceptance 0 on the tiny pair: once its estimates have
  # fallen, `auto` stops drafting but for one probe every 16 steps. (At
  # these costs one draft pays from an acceptance of 0.1 up, so at 0.05 a
  # lucky run of accepted probes rightly keeps it drafting for a while.)
  target, draft = pair
  policy = policies.Auto.create(**COSTS, probe_every=16)
  out = decode.speculative_generate(target, draft, PROMPTS, gamma=policy,
                                    max_new_tokens=MAX_NEW,
                                    synthetic_acceptance=0.0)
  for scored in out.stats.scored:
    last = scored[scored >= 0][-24:]
    assert len(last) == 24 and np.sum(last > 0) <= 3, scored


def test_changing_regime_and_settings_compiles_nothing(pair):
  target, draft = pair
  policy = policies.Auto.create(**COSTS)
  run = lambda gamma, **kw: decode.speculative_generate(
      target, draft, PROMPTS, gamma=gamma, max_new_tokens=8, **kw)
  out = run(policy)
  compiled = loops.speculative_loop._cache_size()
  run(policy.warm(out.policy_state), temperature=0.8, top_k=5)
  run(policy.warm(out.policy_state).priced([1.0, 5.0, 6.0, 7.0], 2.0))
  run(policies.Auto.create(max_gamma=GAMMA, target_ms=[1.0, 5.0, 6.0, 7.0],
                           draft_ms=2.0, prior=0.1), temperature=1.2, key=3)
  assert loops.speculative_loop._cache_size() == compiled
  run(policies.Heuristic(GAMMA))
  compiled = loops.speculative_loop._cache_size()
  run(policies.Heuristic(GAMMA), temperature=0.6, top_p=0.9)
  assert loops.speculative_loop._cache_size() == compiled


def test_errors_name_the_problem(pair):
  target, draft = pair
  with pytest.raises(ValueError, match="'auto' or 'heuristic'"):
    decode.speculative_generate(target, draft, PROMPTS, gamma="fast",
                                max_new_tokens=4)
  with pytest.raises(ValueError, match="max_gamma"):
    policies.Heuristic(0)
  with pytest.raises(ValueError, match="target_ms"):
    policies.Auto.create(max_gamma=4, target_ms=[1.0, 2.0])
  with pytest.raises(ValueError, match="prior"):
    policies.Auto.create(**COSTS, prior=1.5)
  with pytest.raises(ValueError, match="rate"):
    policies.Auto.create(**COSTS, rate=0.0)


def test_auto_times_nothing_inside_a_call(pair, tmp_path, monkeypatch):
  """`gamma="auto"` prices its steps without timing a forward: no table
  is measured (nothing is written to the tuning cache) and the costs come
  from the roofline, a function of the models' bytes alone."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setattr(hardware, "median_ms", _no_timing)
  target, draft = pair
  decode.speculative_generate(target, draft, PROMPTS[:2], gamma="auto",
                              max_gamma=2, max_new_tokens=4, cache_size=96)
  assert not (tmp_path / "tuning" / "cost.json").exists()
  costs = policies.StepCosts.for_call(target, draft, batch=2, cache_size=96,
                                      max_gamma=2)
  assert costs.source == "roofline"
  # Wider passes never cost less, and the smaller draft's forward less
  # than the target's.
  assert list(costs.target_ms) == sorted(costs.target_ms)
  assert 0 < costs.draft_ms < costs.target_ms[0]


def _no_timing(*args, **kwargs):
  raise AssertionError("a forward was timed")


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_auto_reads_the_tuning_steps_table_at_the_calls_cache_size(
    pair, tmp_path, monkeypatch):
  """A forward's cost grows with S (attention reads every slot), so the
  tuning step measures at the S a call runs with, and `gamma="auto"` reads
  that table, not one at another S."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  target, draft = pair
  drafter = drafters.DraftModel(draft)
  measured = tuning.cost.step_costs(target, drafter, batch=2, max_gamma=2,
                                    cache_size=96)
  keys = list(json.loads((tmp_path / "tuning" / "cost.json").read_text()))
  # The target's widths; the draft's step and its two-token first pass.
  assert len(keys) == 2, keys
  assert all("|B=2|S=96|" in k for k in keys), keys
  assert sorted(k.rsplit("|T=", 1)[1] for k in keys) == ["1,2", "1,2,3"], keys
  read = lambda size: policies.StepCosts.for_call(
      target, draft, batch=2, cache_size=size, max_gamma=2)
  assert read(96) == measured and read(96).source == "table"
  assert read(128).source == "roofline"
