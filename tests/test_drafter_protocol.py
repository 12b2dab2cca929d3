"""Drafters written against the public protocol alone, and a real KV-cached
draft that is partly right.

Expectations come from `generate` on the target (an independent loop with
no drafter), from hand-computed fixed-logit chains, and from fresh forwards
of the committed text.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode
from specjax import drafters
from specjax import loops
from specjax import policies
from specjax import speculate
from specjax import testing
from specjax.drafters import DraftModel
from specjax.drafters import Proposal

V = 16


def _successor_table() -> jnp.ndarray:
  """Fixed logits: after t the target picks t + 1, or t + 3 when t % 5 == 0
  (so a drafter guessing "+1" is sometimes wrong)."""
  t = np.arange(V)
  nxt = np.where(t % 5 == 0, t + 3, t + 1) % V
  return jnp.asarray(np.eye(V, dtype=np.float32)[nxt] * 10.0)


@flax.struct.dataclass(kw_only=True)
class CountingState:
  last: jax.Array  # [B] int32 newest committed token
  committed: jax.Array  # [B] int32 tokens committed so far (first included)
  hidden: Any  # [B, E] the target's hidden state after the last draft, or 0


@flax.struct.dataclass
class CountingDrafter(drafters.Drafter):
  """A toy: always proposes last + 1, last + 2, ... (no q: deterministic)."""

  vocab_size: int = flax.struct.field(pytree_node=False)
  hidden_size: int = flax.struct.field(pytree_node=False, default=1)

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    del prompts, prompt_lengths, cache_size
    batch = first_token.shape[0]
    return CountingState(last=first_token,
                         committed=jnp.ones((batch,), jnp.int32),
                         hidden=jnp.zeros((batch, self.hidden_size)))

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    del key, params, stop_threshold, limit
    steps = jnp.arange(1, gamma + 1, dtype=jnp.int32)
    tokens = (state.last[:, None] + steps[None]) % self.vocab_size
    batch = tokens.shape[0]
    return Proposal(tokens=tokens,
                    num_drafted=jnp.full((batch,), gamma, jnp.int32),
                    num_forwards=jnp.int32(0)), state

  def commit(self, state, proposal, verification, active):
    del proposal
    last = jnp.take_along_axis(verification.emitted,
                               verification.num_accepted[:, None], 1)[:, 0]
    hidden = state.hidden
    if verification.hidden is not None:
      hidden = verification.hidden[:, -1]  # after the last draft
    return CountingState(
        last=jnp.where(active, last, state.last),
        committed=state.committed + jnp.where(
            active, verification.num_emitted, 0),
        hidden=jnp.where(active[:, None], hidden, state.hidden))


def test_a_toy_drafter_runs_exact_through_the_engine():
  target = testing.FixedLogitsModel(_successor_table())
  prompts = [[1], [4, 7], [10]]
  out = decode.speculative_generate(target, CountingDrafter(V), prompts,
                                    gamma=3, max_new_tokens=12)
  # The greedy chain by hand: t -> t + 1, or t + 3 when t % 5 == 0.
  for b, prompt in enumerate(prompts):
    want, t = [], prompt[-1]
    for _ in range(12):
      t = (t + 3 if t % 5 == 0 else t + 1) % V
      want.append(t)
    assert out.row(b) == want
  ref = decode.generate(target, prompts, max_new_tokens=12)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  accepted = out.stats.accepted_by_position.sum()
  assert 0 < accepted < out.stats.proposed_by_position.sum()  # partial


def test_commit_receives_the_target_outputs():
  target, _ = testing.tiny_pair(seed=2)
  drafter = CountingDrafter(target.vocab_size,
                            target.config.hidden_size)
  prompts = jnp.asarray([[3, 4, 5, 0], [6, 7, 8, 9]], jnp.int32)
  lengths = jnp.array([3, 4], jnp.int32)
  params = speculate.StepParams.create()
  state = jax.jit(lambda: loops.init_spec_state(
      target, drafter, prompts, lengths, params, jax.random.key(0),
      policy=policies.Fixed(2), max_new_tokens=8, cache_size=32))()
  step = jax.jit(lambda s: speculate.speculate_step(
      s, target=target, drafter=drafter, params=params,
      policy=policies.Fixed(2), max_new_tokens=8))
  before = state
  state = step(state)
  # The hidden state after the last draft, recomputed by a fresh forward of
  # prompt + first token + both drafts.
  for b in range(2):
    n = int(lengths[b])
    first = int(before.last_token[b])
    drafts = [(first + 1) % target.vocab_size, (first + 2) % target.vocab_size]
    text = list(np.asarray(prompts[b, :n])) + [first] + drafts
    fresh, _ = testing.Jitted(target)(jnp.asarray([text], jnp.int32),
                                      target.init_cache(1, 16))
    np.testing.assert_allclose(state.drafter_state.hidden[b],
                               fresh.hidden[0, -1], atol=1e-5)
  np.testing.assert_array_equal(state.drafter_state.committed,
                                state.num_generated)


def _perturbed_draft(target, scale=0.1):
  """The target with noise added to its lm_head: a real KV-cached draft that
  agrees with the target often but not always."""
  head = target.params["lm_head"]
  noise = jax.random.normal(jax.random.key(1), head.shape) * 0.02 * scale
  return target.replace(params={**target.params, "lm_head": head + noise})


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
@pytest.mark.parametrize("gamma", [
    2, pytest.param(4, marks=pytest.mark.extended)])
def test_partial_acceptance_on_a_perturbed_draft(gamma):
  target, _ = testing.tiny_pair(seed=0)
  draft = _perturbed_draft(target)
  prompts = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13]]
  out = decode.speculative_generate(target, draft, prompts, gamma=gamma,
                                    max_new_tokens=40)
  ref = decode.generate(target, prompts, max_new_tokens=40)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  alpha = (out.stats.accepted_by_position.sum()
           / out.stats.proposed_by_position.sum())
  assert 0.2 < alpha < 0.9, alpha


def _check_track_in_sync(track, state, prompts, lengths, draft, b):
  """The track of row b holds the committed text, and its cache the keys of
  a fresh prefill of all of it but the pending tokens. Returns the number
  of pending (uncached) committed tokens."""
  n = int(state.num_generated[b])
  committed = list(prompts[b, :lengths[b]]) + list(
      np.asarray(state.tokens[b, :n]))
  assert int(track.length[b]) == len(committed)
  np.testing.assert_array_equal(track.context[b, :len(committed)], committed)
  cached = int(track.cache.lengths[b])
  assert 1 <= len(committed) - cached
  # Padded to the cache's size, so one program serves every step (keys
  # before slot `cached` do not read the padding: causal attention).
  fed = np.zeros((1, track.cache.size), np.int32)
  fed[0, :cached] = committed[:cached]
  fresh = _prefill_keys(draft, jnp.asarray(fed))
  np.testing.assert_allclose(track.cache.k[:, b, :cached],
                             fresh[:, 0, :cached], atol=1e-5)
  return len(committed) - cached


@jax.jit
def _prefill_keys(model, tokens):
  """[1, P] tokens -> the keys [L, 1, P, K, D] of their fresh prefill."""
  _, cache = model(tokens, model.init_cache(*tokens.shape))
  return cache.k


def _run_steps(target, drafter, prompts, gamma, max_new, on_step,
               num_nodes=None):
  """Runs speculate_step to the end (chains, or trees of `num_nodes`),
  calling on_step(state, prompts, lengths) after each; returns the final
  state and the padded prompts."""
  tokens, lengths, size = decode.prepare_prompts(
      prompts, target.vocab_size, max_new_tokens=max_new, cache_size=None,
      reserve=(num_nodes or gamma) + 1 + drafter.extra_positions)
  params = speculate.StepParams.create()
  policy = policies.Fixed(gamma, num_nodes)
  state = jax.jit(lambda: loops.init_spec_state(
      target, drafter, jnp.asarray(tokens), jnp.asarray(lengths), params,
      jax.random.key(0), policy=policy, max_new_tokens=max_new,
      cache_size=size))()
  step = jax.jit(lambda s: speculate.speculate_step(
      s, target=target, drafter=drafter, params=params, policy=policy,
      max_new_tokens=max_new, num_nodes=num_nodes))
  while not bool(np.all(state.done)):
    state = step(state)
    on_step(state, tokens, lengths)
  ref = decode.generate(target, prompts, max_new_tokens=max_new)
  for b in range(len(prompts)):
    got = np.asarray(state.tokens[b, :int(state.num_generated[b])])
    np.testing.assert_array_equal(got, ref.row(b))
  return state


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_draft_cache_stays_in_sync_with_the_committed_text():
  # Step by step, the draft's cache must hold the committed text but its
  # pending tokens, with keys equal to a fresh prefill of it; the case
  # where every draft was accepted (its last draft never fed, so two tokens
  # are pending) must occur and stay in sync too.
  target, _ = testing.tiny_pair(seed=0)
  draft = _perturbed_draft(target)
  seen = {"pending": set(), "partial": False}

  def check(state, prompts, lengths):
    for b in range(2):
      if not bool(state.done[b]):
        seen["pending"].add(_check_track_in_sync(
            state.drafter_state, state, prompts, lengths, draft, b))
    last = state.stats.accepted[:, int(state.stats.steps) - 1]
    seen["partial"] |= bool(np.any((last >= 0) & (last < 3)))

  _run_steps(target, DraftModel(draft), [[5, 17, 99, 3], [42]], 3, 30, check)
  assert seen["pending"] == {1, 2} and seen["partial"], seen
