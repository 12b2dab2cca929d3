"""Runs of plain steps (`specjax.plain`) against the step they stand for.

The reference for a run of r plain steps is r calls of
`speculate.speculate_step` with a budget of zero (what the loop ran before
plain runs existed); for a policy's run length, `Auto.budget` asked again
before each of those steps.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafters
from specjax import loops
from specjax import plain
from specjax import policies
from specjax import speculate
from specjax import testing
from specjax.padding import prepare_prompts
from specjax.step_types import Proposal
from specjax.step_types import SpecStats
from specjax.step_types import StepParams

GAMMA = 4
TOKENS = 12
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]]


@flax.struct.dataclass
class _StepwiseDraftModel(drafters.DraftModel):
  """A draft model whose commits the run makes at every step."""

  commits_text = False


def _policy(**kw) -> policies.Auto:
  return policies.Auto.create(max_gamma=GAMMA, target_ms=[1.0, 1.2, 1.4, 1.8],
                              draft_ms=0.3, **kw)


@pytest.fixture(scope="module")
def pair():
  return testing.tiny_pair(seed=3)


def _state(target, drafter, policy):
  prompts, lengths, cache_size = prepare_prompts(
      PROMPTS, target.vocab_size, max_new_tokens=TOKENS, cache_size=None,
      reserve=GAMMA + 1)
  return loops.init_spec_state(
      target, drafter, jnp.asarray(prompts), jnp.asarray(lengths),
      StepParams.create(), jax.random.key(0), policy=policy,
      max_new_tokens=TOKENS, cache_size=cache_size)


def _drafter_text(drafter_state):
  """Each row's committed text and the cache's length, as numpy."""
  track = getattr(drafter_state, "track", drafter_state)
  length = np.asarray(track.length)
  context = np.asarray(track.context)
  cached = getattr(getattr(track, "cache", None), "lengths", None)
  return ([context[b, :length[b]].tolist() for b in range(len(length))],
          None if cached is None else np.asarray(cached).tolist())


@pytest.mark.parametrize("make", [
    lambda d: drafters.DraftModel(d),
    lambda d: _StepwiseDraftModel(d),
    lambda d: drafters.PromptLookup(vocab_size=d.vocab_size),
], ids=["draft model", "draft model, commit per step", "lookup"])
@pytest.mark.parametrize("steps", [3, 7, 30])
def test_a_run_equals_plain_speculative_steps(pair, make, steps):
  target, draft = pair
  drafter, policy = make(draft), _policy(prior=0.0)
  start = _state(target, drafter, policy)
  params = StepParams.create()
  kw = dict(target=target, drafter=drafter, params=params, policy=policy,
            max_new_tokens=TOKENS)
  step = jax.jit(functools.partial(
      speculate.speculate_step, budget=jnp.zeros((len(PROMPTS),), jnp.int32),
      **kw))
  want = start
  for _ in range(steps):
    if np.all(want.done):  # as the loop would stop
      break
    want = step(want)
  got = jax.jit(functools.partial(plain.plain_run, **kw))(start,
                                                         jnp.int32(steps))
  for name in ("num_generated", "done", "last_token"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name),
                                  err_msg=name)
  # Past a row's count the buffer holds junk (a step writes G + 1 slots).
  real = np.arange(got.tokens.shape[1]) < np.asarray(got.num_generated)[:, None]
  np.testing.assert_array_equal(np.where(real, got.tokens, -1),
                                np.where(real, want.tokens, -1))
  np.testing.assert_array_equal(got.target_cache.lengths,
                                want.target_cache.lengths)
  assert _drafter_text(got.drafter_state) == _drafter_text(
      want.drafter_state)
  for name in ("accepted", "scored", "steps", "target_forwards",
               "proposed", "draft_forwards"):
    np.testing.assert_array_equal(getattr(got.stats, name),
                                  getattr(want.stats, name), err_msg=name)
  assert int(got.policy_state.idle) == int(want.policy_state.idle)


def test_plain_stats_equal_stepwise_counts():
  stats = SpecStats.zeros(3, GAMMA, 20).update(
      Proposal(tokens=jnp.zeros((3, GAMMA), jnp.int32),
               num_drafted=jnp.array([2, 4, 1]), num_forwards=jnp.int32(4)),
      jnp.array([1, 4, 0]), jnp.array([True, True, True]))
  ran = jnp.array([5, 2, 0])  # rows ending after 5, 2 and 0 of 5 steps
  nothing = Proposal(tokens=jnp.zeros((3, GAMMA), jnp.int32),
                     num_drafted=jnp.zeros((3,), jnp.int32),
                     num_forwards=jnp.int32(0))
  want = stats
  for j in range(5):
    want = want.update(nothing, jnp.zeros((3,), jnp.int32), j < ran, 0)
  got = stats.plain(ran, jnp.int32(5))
  for name in ("accepted", "scored", "proposed", "accepted_by_position",
               "proposed_by_position", "steps", "target_forwards",
               "draft_forwards"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name),
                                  err_msg=name)


@pytest.mark.parametrize("kw, remaining", [
    (dict(prior=0.0), 200),                       # probes due, far from end
    (dict(prior=0.0, probe_first=False), 200),
    (dict(prior=0.0, probe_first=False), 90),      # reaches the horizon
    (dict(prior=0.0, probe_first=False), 40),      # near the end
    (dict(prior=0.2, probe_every=4, probe_max=8), 200),
    (dict(prior=0.2, probe_every=4, probe_max=8, horizon=0), 50),
])
def test_a_run_ends_where_the_policy_would_draft(kw, remaining):
  policy = _policy(**kw)
  active = jnp.array([True, True])
  budget = jax.jit(policy.budget)
  run = jax.jit(policy.plain_run)
  state = policy.init(2)
  left = jnp.array([remaining, remaining - 3])
  checked = 0
  for _ in range(6):  # successive runs, each checked step by step
    if int(jnp.max(budget(state, active, left))) > 0:
      # What a probe would learn: one rejected first draft.
      state = policy.update(
          state, jnp.ones((2,), jnp.int32),
          Proposal(tokens=jnp.zeros((2, GAMMA), jnp.int32),
                   num_drafted=jnp.ones((2,), jnp.int32),
                   num_forwards=jnp.int32(1)),
          jnp.zeros((2,), jnp.int32), active)
      left = left - 1
      continue
    full = int(run(state, active, left))
    assert 1 <= full <= policies.LONGEST_PLAIN_RUN
    r = min(full, int(jnp.min(left)))  # the loop stops where a row ends
    for i in range(r):
      assert int(jnp.max(budget(policy.after_plain(state, i), active,
                                left - i))) == 0, (i, r)
    state, left = policy.after_plain(state, r), left - r
    checked += r
    if r == full < policies.LONGEST_PLAIN_RUN and (
        not policy.horizon or int(jnp.max(left)) > policy.horizon):
      # Not cut by the horizon or the run's cap: a probe is due now.
      assert int(jnp.max(budget(state, active, left))) > 0, r
    if int(jnp.min(left)) <= 1:
      break
  assert checked > 0
