"""The compiled generations: prefill, then one `lax.while_loop`.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, N
max new tokens, N_cap its cap, G = γ, V vocab, E hidden.

`generate_loop` is autoregressive decoding (`plain.target_step`) and
`speculative_loop` runs `speculate.speculate_step` until every row hit EOS
or N tokens, taking the plain steps of a policy that declares plain runs
(`policies.PlainRuns`) as runs of `generate`'s step (`plain.plain_run`);
both start with `start` (the target's prefill and its first token).
`specjax.decode` validates arguments and calls them.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import buffers
from specjax import plain
from specjax import rejection
from specjax import sampling
from specjax import speculate
from specjax import streaming
from specjax.drafters.base import Drafter
from specjax.models import LanguageModel
from specjax.models.protocol import declared
from specjax.policies.base import GammaPolicy
from specjax.step_types import SpecState
from specjax.step_types import SpecStats
from specjax.step_types import StepParams

__all__ = ["Started", "first_acceptance", "generate_loop",
           "init_spec_state", "prng_key", "speculative_loop", "start",
           "synthetic_text"]


@flax.struct.dataclass(kw_only=True)
class _ARState:
  """The autoregressive loop's state.

  Attributes:
    tokens: [B, N_cap + 1] int32 generated tokens.
    num_generated: [B] int32 tokens generated per row.
    done: [B] bool rows that stopped.
    last_token: [B] int32 newest token, not yet in the cache.
    cache: the model's cache.
    key: PRNG key.
    params: the sampling settings, with the controls' history
      (`specjax.controls`) through `last_token`.
    stop_state: [B] int32 the stop strings' automaton state, or None.
  """

  tokens: jax.Array
  num_generated: jax.Array
  done: jax.Array
  last_token: jax.Array
  cache: Any
  key: jax.Array
  params: sampling.SamplingParams
  stop_state: jax.Array | None = None


@flax.struct.dataclass(kw_only=True)
class Started:
  """The target's prefill and first token (`start`).

  Attributes:
    first: [B] int32 the first generated token.
    probs: [B, V] float32 the distribution it was drawn from.
    cache: the target's cache after the prompts.
    tokens: [B, W] int32 the output buffer, holding `first`.
    counts: [B] int32 tokens generated (1, or 0 past N = 0).
    done: [B] bool rows that already stopped.
    key: the PRNG key left for the loop.
    params: the sampling settings with the controls' history through
      `first`.
    stop_state: [B] int32 the stop strings' state after `first`, or None.
    hidden: [B, P, E] the target's hidden states over the prompts (only
      with `return_hidden`), else None.
  """

  first: jax.Array
  probs: jax.Array
  cache: Any
  tokens: jax.Array
  counts: jax.Array
  done: jax.Array
  key: jax.Array
  params: sampling.SamplingParams
  stop_state: jax.Array | None = None
  hidden: jax.Array | None = None


def prng_key(key: jax.Array | int | None) -> jax.Array:
  """A PRNG key for a `key` argument: a key as is, an int seed (default
  0) as `jax.random.key(seed)`, made on the host (`sampling.host_key`)."""
  if key is None:
    return sampling.host_key(0)
  if isinstance(key, (int, np.integer)):
    return sampling.host_key(key)
  return key


def start(target: LanguageModel, prompts: jax.Array, lengths: jax.Array,
          params: sampling.SamplingParams, eos_ids: jax.Array, key: jax.Array,
          *, cache_size: int, width: int, max_new_tokens: int,
          return_hidden: bool = False, stops: Any = None) -> Started:
  """Prefills the target, samples and emits the first token."""
  key, first_key = jax.random.split(key)
  cache = target.init_cache(prompts.shape[0], cache_size)
  hidden = None
  if return_hidden:
    logits, cache, hidden = target.prefill(prompts, lengths, cache,
                                           return_hidden=True)
  else:
    logits, cache = target.prefill(prompts, lengths, cache)  # [B, V]
  if params.controls is not None:
    params = params.replace(controls=params.controls.start(
        prompts, lengths, logits.shape[-1]))
  probs = sampling.probabilities(logits, params)  # [B, V]
  first = sampling.sample(first_key, probs)
  batch = first.shape[0]
  stop_state = None if stops is None else jnp.zeros((batch,), jnp.int32)
  tokens, counts, done, stop_state = buffers.emit(
      jnp.zeros((batch, width), jnp.int32), jnp.zeros((batch,), jnp.int32),
      jnp.zeros((batch,), bool), first[:, None], jnp.ones((batch,), jnp.int32),
      eos_ids, max_new_tokens, stops, stop_state)
  return Started(first=first, probs=probs, cache=cache, tokens=tokens,
                 counts=counts, done=done, key=key,
                 params=params.advance(first), stop_state=stop_state,
                 hidden=hidden)


@functools.partial(jax.jit, static_argnames=("tokens_cap", "cache_size",
                                             "pad_id"))
def generate_loop(model: LanguageModel, prompts, lengths, params, eos_ids,
                  key, max_new_tokens, stops=None, stream_id=None, *,
                  tokens_cap, cache_size, pad_id):
  """The whole autoregressive generation; returns tokens [B, N_cap] and
  lengths [B]. `stops`: stop strings or None; `stream_id`: a
  `specjax.streaming` stream or None."""
  s0 = start(model, prompts, lengths, params, eos_ids, key,
             cache_size=cache_size, width=tokens_cap + 1,
             max_new_tokens=max_new_tokens, stops=stops)
  streaming.deliver(stream_id, s0.tokens, jnp.zeros_like(s0.counts),
                    s0.counts, 1)
  state = _ARState(tokens=s0.tokens, num_generated=s0.counts, done=s0.done,
                   last_token=s0.first, cache=s0.cache, key=s0.key,
                   params=s0.params, stop_state=s0.stop_state)

  def step(s: _ARState) -> _ARState:
    key, sample_key = jax.random.split(s.key)
    e = plain.target_step(model, s.cache, s.last_token, s.params,
                          sample_key, s.tokens, s.num_generated, s.done,
                          eos_ids, max_new_tokens, stops, s.stop_state)
    streaming.deliver(stream_id, e.tokens, s.num_generated, e.counts, 1)
    return s.replace(tokens=e.tokens, num_generated=e.counts, done=e.done,
                     last_token=e.token, cache=e.cache, key=key,
                     params=e.params, stop_state=e.stop_state)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
  return (buffers.finalize(state.tokens, state.num_generated, tokens_cap,
                           pad_id), state.num_generated)


def init_spec_state(target: LanguageModel, drafter: Drafter,
                    prompts: jax.Array, lengths: jax.Array,
                    params: StepParams, key: jax.Array, *,
                    policy: GammaPolicy,
                    max_new_tokens: int | jax.Array, cache_size: int,
                    tokens_cap: int | None = None) -> SpecState:
  """Prefills target and drafter and emits the target's first token.

  Where the drafter's prefill guesses the first token too (`init_guess`),
  the policy observes how likely that guess was to be accepted
  (`first_acceptance`) before any step drafts.

  Args:
    target: the verifying `LanguageModel`.
    drafter: a `Drafter` (e.g. `DraftModel(draft)`).
    prompts: [B, P] int32 right-padded prompts (`prepare_prompts`).
    lengths: [B] int32 prompt lengths.
    params: traced settings (`StepParams.create`).
    key: PRNG key.
    policy: the γ policy (`specjax.policies.GammaPolicy`; G is its
      `max_gamma`).
    max_new_tokens: N (an int or a traced [] int32).
    cache_size: S.
    tokens_cap: N_cap, the static output width (default N, which must then
      be an int).

  Returns:
    The `SpecState` that `speculate.speculate_step` advances.
  """
  cap = max_new_tokens if tokens_cap is None else tokens_cap
  gamma = policy.max_gamma
  # A drafter reading the target's features (EAGLE) gets the prompt's.
  features = drafter.uses_prompt_hidden
  s0 = start(target, prompts, lengths, params.sampling, params.eos_ids, key,
             cache_size=cache_size, width=cap + gamma + 1,
             max_new_tokens=max_new_tokens, return_hidden=features,
             stops=params.stops)
  extra = {"prompt_hidden": s0.hidden} if features else {}
  drafter_state, guess = drafter.init_guess(prompts, lengths, s0.first,
                                            cache_size, **extra)
  policy_state = policy.init(prompts.shape[0])
  if guess is not None:
    policy_state = policy.observe(
        policy_state, first_acceptance(
            s0.probs, guess, params.replace(sampling=s0.params), lengths),
        ~s0.done)
  return SpecState(
      tokens=s0.tokens, num_generated=s0.counts, done=s0.done,
      last_token=s0.first, target_cache=s0.cache,
      drafter_state=drafter_state, key=s0.key,
      stats=SpecStats.zeros(prompts.shape[0], gamma, max(cap - 1, 1),
                            drafter.components),
      policy_state=policy_state, controls=s0.params.controls,
      stop_state=s0.stop_state)


def synthetic_text(key: jax.Array | int | None) -> jax.Array:
  """The PRNG key of the synthetic text (`acceptance.Synthetic`) that a
  generation with `key` decodes: every policy, γ and drafter run with one
  key meets the same verdicts at each sequence position."""
  return jax.random.fold_in(prng_key(key), 2)


def first_acceptance(probs: jax.Array, guess: jax.Array, params: StepParams,
                     positions: jax.Array) -> jax.Array:
  """[B] float32 how likely a first draft from the drafter's `guess`
  logits [B, V] was to be accepted against the target's first-token
  distribution `probs` [B, V] (`rejection.acceptance_probability`, 0 or 1
  under greedy decoding); with synthetic acceptance, the verdict of
  `params.acceptance`'s text on the first token's sequence position
  (`positions` [B], the prompts' lengths), as a verified draft there
  would get."""
  if params.acceptance.synthetic:
    return params.acceptance.accepts(positions[:, None])[:, 0].astype(
        jnp.float32)
  return rejection.acceptance_probability(
      probs, sampling.probabilities(guess, params.sampling))


@functools.partial(jax.jit, static_argnames=(
    "tokens_cap", "cache_size", "pad_id", "num_nodes"))
def speculative_loop(target: LanguageModel, drafter: Drafter, prompts,
                     lengths, params, key, max_new_tokens,
                     policy: GammaPolicy, stream_id=None, *, tokens_cap,
                     cache_size, pad_id, num_nodes):
  """The whole speculative generation; returns tokens [B, N_cap],
  lengths [B], the `SpecStats` and the policy's final state.
  `stream_id`: a `specjax.streaming` stream or None."""
  if params.acceptance.synthetic:
    params = params.with_text(synthetic_text(key))
  # What a pass of the widest verification would dequantise, once per
  # call: XLA hoists it out of the loop, but not out of an adaptive
  # step's width branches (`DeclaredModel.for_branches`).
  target = declared(target).for_branches(
      prompts.shape[0] * (max(policy.max_gamma, num_nodes or 0) + 1))
  state = init_spec_state(target, drafter, prompts, lengths, params, key,
                          policy=policy, max_new_tokens=max_new_tokens,
                          cache_size=cache_size, tokens_cap=tokens_cap)
  streaming.deliver(stream_id, state.tokens,
                    jnp.zeros_like(state.num_generated), state.num_generated,
                    1)
  step = functools.partial(
      speculate.speculate_step, target=target, drafter=drafter, params=params,
      policy=policy, max_new_tokens=max_new_tokens, num_nodes=num_nodes)

  def streamed(s: SpecState, **kw) -> SpecState:
    after = step(s, **kw)
    streaming.deliver(stream_id, after.tokens, s.num_generated,
                      after.num_generated, policy.max_gamma + 1)
    return after

  def body(s: SpecState) -> SpecState:
    if not policy.plain_runs:  # the policy is asked before every step
      return streamed(s)
    remaining = max_new_tokens - s.num_generated  # [B]
    budget = policy.budget(s.policy_state, s.active, remaining)  # [B]
    drafting = jnp.any(budget > 0)
    # The run's length is asked only after a plain choice.
    steps = jax.lax.cond(
        drafting, lambda: jnp.int32(0),
        lambda: policy.plain_run(s.policy_state, s.active, remaining))
    s = plain.plain_run(s, steps, target=target, drafter=drafter,
                        params=params, policy=policy,
                        max_new_tokens=max_new_tokens, stream_id=stream_id)
    # At most one drafting step: a `lax.cond` whose other branch passed
    # the state through would make XLA copy the caches at every step.
    _, s = jax.lax.while_loop(
        lambda c: c[0], lambda c: (False, streamed(c[1], budget=budget)),
        (drafting, s))
    return s

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  tokens = buffers.finalize(state.tokens, state.num_generated, tokens_cap,
                            pad_id)
  return tokens, state.num_generated, state.stats, state.policy_state


