"""Adaptive γ (`gamma="auto"`, `"heuristic"`): exact, switching, no recompile.

Expectations come from independent computations: autoregressive `generate`
on the same target, the cost model's own `StepCosts.tokens_per_s`, and
transformers' schedule written out by hand.
"""

import dataclasses
import functools
import json

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance
from specjax import policies
from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import loops
from specjax import speculate
from specjax import testing
from specjax.drafters.base import Proposal
from specjax import tuning
from specjax.policies import simulate

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 48
GAMMA = 4
# A policy's budget and trim, compiled once per policy structure (eager,
# each of `finish`'s loops dispatches op by op).
_budget = jax.jit(lambda policy, state, active, remaining=None:
                  policy.budget(state, active, remaining))
_trim = jax.jit(lambda policy, state, drafted, active, remaining=None:
                policy.trim(state, drafted, active, remaining))

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


# The default suite runs `auto` with the draft model, the slow step the
# heuristic with it, and `-m extended` the other drafters.
_EXTENDED = (pytest.mark.slow, pytest.mark.extended)
@pytest.mark.parametrize("policy, kind", [
    ("auto", "model"),
    pytest.param("heuristic", "lookup", marks=_EXTENDED),
    pytest.param("auto", "lookup", marks=_EXTENDED),
    pytest.param("heuristic", "model", marks=pytest.mark.slow),
    pytest.param("auto", "fallback", marks=_EXTENDED),
    pytest.param("heuristic", "fallback", marks=_EXTENDED),
    pytest.param("auto", "cascade", marks=_EXTENDED),
    pytest.param("heuristic", "cascade", marks=_EXTENDED)])
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


def test_auto_compiles_only_the_widths_worth_a_pass():
  # G = 8: widths 1, 2, 3, 5, 9. Passes that cost within 5% of the next
  # larger width kept are dropped; a compute-bound table keeps them all.
  flat = policies.StepCosts(max_gamma=8, target_ms=(10.0, 10.2, 10.3, 10.4,
                                                    10.5))
  assert flat.worth_compiling().widths == (1, 9)
  assert flat.worth_compiling().target_ms == (10.0, 10.5)
  steep = policies.StepCosts(max_gamma=8, target_ms=(10.0, 14.0, 18.0, 26.0,
                                                     42.0))
  assert steep.worth_compiling() == steep
  mixed = policies.StepCosts(max_gamma=8, target_ms=(10.0, 12.0, 12.1, 20.0,
                                                     20.5))
  assert mixed.worth_compiling().widths == (1, 3, 9)
  with pytest.raises(ValueError, match="widths must ascend from 1"):
    policies.Auto.create(max_gamma=GAMMA, target_ms=[1.0, 2.0],
                         widths=(2, GAMMA + 1))


@pytest.mark.slow  # a whole generation; the slow step
def test_auto_over_two_widths_decodes_exactly(pair, baseline):
  # A policy over (1, G + 1) prices a 2-token proposal at the wide pass
  # and still decodes exactly.
  target, draft = pair
  costs = policies.StepCosts(max_gamma=GAMMA, **{
      k: v for k, v in COSTS.items() if k != "max_gamma"})
  pruned = dataclasses.replace(
      costs, widths=(1, GAMMA + 1),
      target_ms=(costs.target_ms[0], costs.target_ms[-1]))
  policy = policies.Auto.from_costs(pruned)
  assert policy.widths == policy.costs().widths == (1, GAMMA + 1)
  np.testing.assert_allclose(policy.costs().target_ms, pruned.target_ms,
                             rtol=1e-6)
  out = decode.speculative_generate(target, drafters.DraftModel(draft),
                                    PROMPTS, gamma=policy,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)


@pytest.mark.slow  # a whole generation per regime; the slow step
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


def test_may_draft_weighs_the_draft_prefill_over_the_call():
  # At certain acceptance COSTS's best budget is K = 4: 5 tokens for
  # 1.2 + 0.05 + 3 * 0.05 = 1.4 ms, against 1 token per 1 ms plain, so each
  # token saves 1 - 1.4 / 5 = 0.72 ms: 7.2 ms over 10 tokens.
  policy = policies.Auto.create(**COSTS, first_draft_ms=0.05)
  assert policy.may_draft(10, prefill_ms=7.1)
  assert not policy.may_draft(10, prefill_ms=7.3)
  assert policy.may_draft(None, prefill_ms=1e9)  # no end: it repays
  assert not policies.Auto.create(**HOPELESS).may_draft(10**6)
  assert policies.Heuristic(GAMMA).may_draft(1, prefill_ms=1e9)


@pytest.mark.parametrize("scale", [1e-4, 1e4])
def test_auto_decodes_autoregressively_where_drafts_cannot_repay_the_prefill(
    pair, scale):
  # The same relative costs: at 1e-4 ms a plain step, drafting saves
  # less over MAX_NEW tokens than the draft model's prefill costs (the
  # roofline's, at least its fixed overhead per pass), and `generate`
  # runs; at 1e4 ms it repays it many times, and the call drafts.
  target, draft = pair
  costs = dict(COSTS, target_ms=[t * scale for t in COSTS["target_ms"]],
               draft_ms=COSTS["draft_ms"] * scale)
  kwargs = dict(max_new_tokens=MAX_NEW, key=3, eos_id=7)
  ref = decode.generate(target, PROMPTS, **kwargs)
  out = decode.speculative_generate(
      target, draft, PROMPTS, gamma=policies.Auto.create(**costs), **kwargs)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert (int(np.sum(out.stats.draft_forwards)) == 0) == (scale < 1)


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
  budget = _budget(policy, state, jnp.array([True, True, True]))
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
  # The in-loop choice must agree with `StepCosts.tokens_per_s` evaluated
  # on the host for each γ, with the width each γ runs at.
  widths = policies.verify_widths(8)
  assert widths == (1, 2, 3, 5, 9)
  target_ms = [100.0, 104.0, 107.0, 118.0, 160.0]
  for acceptance, draft_ms in [(0.9, 5.0), (0.6, 5.0), (0.2, 0.0),
                               (0.97, 0.0), (0.75, 30.0)]:
    # A step's first draft token is a dearer two-token catch-up pass.
    draft = policies.ForwardCosts(batch=2, forward_ms={1: draft_ms,
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
    budget = int(_budget(policy, state, active)[0])
    if draft_ms:
      chosen = budget
    else:
      # Free drafts: draft all, then verify the best prefix of them.
      assert budget == 8
      chosen = int(_trim(policy, state, jnp.array([8, 8]), active)[0])

    costs = policies.StepCosts.from_forwards(
        8, policies.ForwardCosts(2, dict(zip(widths, target_ms))),
        draft if draft_ms else None)
    predicted = lambda g: costs.tokens_per_s([acceptance] * g, g, batch=2)

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
      _trim(policy, state, jnp.array([0, 0]), active), [0, 0])
  np.testing.assert_array_equal(
      _trim(policy, state, jnp.array([2, 1]), active), [2, 2])
  np.testing.assert_array_equal(
      _trim(policy, state, jnp.array([4, 0]), active), [4, 4])


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
  np.testing.assert_array_equal(_budget(policy, state, active), [4, 4])
  for left, usable in ((9, 4), (3, 2), (2, 1), (1, 0)):
    remaining = jnp.array([left, left])
    np.testing.assert_array_equal(
        _budget(policy, state, active, remaining), [usable] * 2)
    np.testing.assert_array_equal(
        _trim(policy, state, jnp.array([4, 4]), active, remaining),
        [usable] * 2)
  # Rows with different ends: the batch takes the longest useful budget.
  np.testing.assert_array_equal(
      _budget(policy, state, active, jnp.array([2, 3])), [2, 2])


def test_near_the_end_auto_chooses_by_when_the_batch_ends():
  # Once no row has over `horizon` tokens left, the in-loop choice must
  # agree with `StepCosts.tokens_per_s(..., tokens=r)` on the
  # host, which waits for the slowest of B rows. Machine G's B = 32 costs
  # (ms; widths 1, 2, 3, 5): at α = 0.5 one draft is 1.06x a plain step
  # in the steady state but not over 31 tokens; at 0.8 it pays both ways.
  target_ms = [1063.5, 1107.4, 1500.4, 2131.2]
  draft = policies.ForwardCosts(batch=32, forward_ms={1: 367.5, 2: 392.9})
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
      chosen[acceptance, horizon, serial] = int(_budget(policy, 
          state, active, jnp.full((batch,), left))[0])

    costs = policies.StepCosts.from_forwards(
        GAMMA, policies.ForwardCosts(batch, dict(zip(widths, target_ms))),
        draft)
    predicted = lambda g, tokens: costs.tokens_per_s(
        [acceptance] * g, g, batch=batch, tokens=tokens)

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


@pytest.mark.parametrize("temperature", [
    0.0, pytest.param(1.0, marks=pytest.mark.slow)])
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
  start = lambda drafter, **kw: _policy_at_start(
      target, drafter, jnp.asarray(prompts), jnp.asarray(lengths),
      speculate.StepParams.create(temperature=temperature, **kw), policy,
      cache_size=size)

  def next_probs(model, prompt):
    out, _ = testing.Jitted(model)(jnp.asarray([prompt], jnp.int32),
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
    state = start(drafters.DraftModel(draft),
                  acceptance=acceptance.Synthetic.create(rate))
    np.testing.assert_allclose(state.accepted[:, 0], 0.665 + rate,
                               rtol=1e-6)
  # A drafter whose prefill guesses nothing (prompt lookup) observes
  # nothing and probes at its first step.
  state = start(drafters.PromptLookup(vocab_size=target.vocab_size))
  np.testing.assert_array_equal(state.seen_verified[:, 0], 0.0)
  assert int(state.wait) == 0


# Jitted once per drafter kind: op by op, a prefill takes seconds here.
@functools.partial(jax.jit, static_argnames=("cache_size",))
def _policy_at_start(target, drafter, prompts, lengths, params, policy, *,
                     cache_size):
  """The policy state `loops.init_spec_state` starts from (N = 8)."""
  return loops.init_spec_state(
      target, drafter, prompts, lengths, params, jax.random.key(0),
      policy=policy, max_new_tokens=8,
      cache_size=cache_size).policy_state


# Costs measured on machine F at B = 1 (ms; targets at T = 1, 2, 3, 5).
F_B1 = dict(max_gamma=GAMMA, target_ms=[230.0, 342.0, 328.0, 387.0],
            draft_ms=91.0, first_draft_ms=105.0)
# Machine F's at B = 4: even certain acceptance gains 2.6%.
F_B4 = dict(max_gamma=GAMMA, target_ms=[348.0, 526.0, 709.0, 1188.0],
            draft_ms=120.0, first_draft_ms=189.0)
# Committed cost tables (results/never_slower/*/crossover.json; ms; the
# target at T = 1, 2, 3, 5, the draft model at T = 1 and 2).
MACHINE_B_B1 = policies.StepCosts(
    max_gamma=GAMMA, target_ms=(157.5, 181.5, 185.8, 197.2),
    draft_ms=61.7, first_draft_ms=61.2)
MACHINE_C_B8 = policies.StepCosts(
    max_gamma=GAMMA, target_ms=(343.7, 474.8, 622.6, 886.1),
    draft_ms=104.4, first_draft_ms=150.0)


@pytest.mark.slow  # two simulated sweeps per cost set
@pytest.mark.parametrize("batch, costs", [
    (1, MACHINE_B_B1),
    pytest.param(8, MACHINE_C_B8, marks=pytest.mark.extended)])
def test_auto_loses_little_to_the_best_fixed_gamma(batch, costs):
  """The outcome that matters: over 32 tokens, from its prior (cold) and
  from what one earlier generation learned (warm), `auto` is within 5% of
  the best of autoregressive decoding and every fixed γ in hindsight
  (simulated: no timing noise), at an acceptance where drafting loses
  and at two where it pays. A fixed γ fails this at one α or another:
  the check below keeps the bound meaningful."""
  policy = policies.Auto.from_costs(costs)
  ratio = lambda p, alpha, **kw: simulate.over_best(
      p, costs, alpha=alpha, batch=batch, tokens=32, samples=128, **kw)
  for alpha in (0.05, 0.8, 0.95):
    assert ratio(policy, alpha) >= 0.95, alpha
    assert ratio(policy, alpha, warm_after=1) >= 0.95, alpha
  assert min(ratio(policies.Fixed(2), a) for a in (0.05, 0.95)) < 0.95


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


def test_a_dear_probe_waits_in_proportion_to_its_price():
  """Prompt lookup (no draft model) at costs where a two-token pass is
  1.77 plain steps: a probe costs 0.77 of a plain step beyond one, over
  the default `probe_price` of 0.25, so the first scheduled probe (wait
  16) waits 16 * 0.77 / 0.25 = 49.3 plain steps, i.e. falls due at the
  50th; with a `probe_price` of 1 at the 16th, as does a probe that costs
  0.05 of a step at the default."""
  dear = dict(max_gamma=GAMMA, target_ms=[1.0, 1.77, 2.1, 4.6])
  due_at = lambda policy: next(
      idle for idle in range(1, 200)
      if policy._due(policy.init(1).replace(idle=jnp.int32(idle),
                                            wait=policy.probe_every)))
  assert due_at(policies.Auto.create(**dear)) == 50
  assert due_at(policies.Auto.create(**dear, probe_price=1.0)) == 16
  assert due_at(policies.Auto.create(
      max_gamma=GAMMA, target_ms=[1.0, 1.05, 1.1, 1.2])) == 16
  with pytest.raises(ValueError, match="probe_price"):
    policies.Auto.create(**dear, probe_price=0.0)


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
  with pytest.raises(ValueError, match="optimism"):
    policies.Auto.create(**COSTS, optimism=-1.0)
  with pytest.raises(ValueError, match="probe_max"):
    policies.Auto.create(**COSTS, probe_every=8, probe_max=4)


def test_auto_times_nothing_inside_a_call(pair, tmp_path, monkeypatch):
  """`gamma="auto"` prices its steps without timing a forward: no table
  is measured (nothing is written to the tuning cache) and the costs come
  from the roofline, a function of the models' bytes alone."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setattr(hardware, "median_ms", _no_timing)
  monkeypatch.setattr(hardware, "looped_ms", _no_timing)
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
  assert sorted(k.split("|T=")[1].split("|")[0] for k in keys) == [
      "1,2", "1,2,3"], keys
  read = lambda size: policies.StepCosts.for_call(
      target, draft, batch=2, cache_size=size, max_gamma=2)
  assert read(96) == measured and read(96).source == "table"
  assert read(128).source == "roofline"
