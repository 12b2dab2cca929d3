"""Target-only steps: `generate`'s step, and runs of it in the speculative
loop.

Shape letters (`specjax.shapes`): B batch, V vocab, W output buffer width,
G = γ_max.

`target_step` is one autoregressive step: the target reads the newest
token, the next is sampled from its distribution and emitted. `generate`
runs nothing else; under an adaptive policy (`policies.Auto`) most steps
of a poorly drafting pair are such plain steps. Taken through
`speculate_step`, a plain step pays for the machinery of a drafting one:
the policy's choice, the width switch, the rejection sampler, the
statistics. Once a policy that declares plain runs (`policies.PlainRuns`)
chooses a plain step it also says how many plain steps that choice stands
for (`PlainRuns.plain_run`), and `plain_run` takes them in a loop of
`target_step`s with the drafter's `commit`, at about `generate`'s
operations per step (on a GPU each operation is a kernel
launch), counting them in the statistics and the policy's state once at
the end. The tokens are those `speculate_step`
would emit: a plain step's verification samples the next token from the
target's distribution at the last committed token, as here.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import buffers
from specjax import sampling
from specjax import streaming
from specjax.drafters import text
from specjax.drafters.base import Drafter
from specjax.models.protocol import LanguageModel
from specjax.models.protocol import ModelOutput
from specjax.models.protocol import model_output
from specjax.policies.base import LONGEST_PLAIN_RUN
from specjax.policies.base import PlainRuns
from specjax.step_types import Proposal
from specjax.step_types import SpecState
from specjax.step_types import StepParams
from specjax.step_types import Verification

__all__ = ["Emitted", "commit_text", "plain_run", "target_step"]


@flax.struct.dataclass(kw_only=True)
class Emitted:
  """One target-only step's result (`target_step`).

  Attributes:
    token: [B] int32 the token sampled (emitted where the row was active).
    probs: [B, V] float32 the distribution it was drawn from.
    out: the target's `ModelOutput` over the one-token chunk ([B, 1, V]
      logits, [B, 1, E] hidden states where the model returns them).
    cache: the target's cache, holding the token read (rows that were
      done keep their length).
    tokens, counts, done, stop_state: `buffers.emit`'s results.
    params: the sampling settings, the controls' history through `token`.
  """

  token: jax.Array
  probs: jax.Array
  out: ModelOutput
  cache: Any
  tokens: jax.Array
  counts: jax.Array
  done: jax.Array
  stop_state: jax.Array | None
  params: sampling.SamplingParams


def target_step(target: LanguageModel, cache: Any, last_token: jax.Array,
                params: sampling.SamplingParams, key: jax.Array,
                tokens: jax.Array, counts: jax.Array, done: jax.Array,
                eos_ids: jax.Array, max_new_tokens: int | jax.Array,
                stops: Any = None, stop_state: jax.Array | None = None
                ) -> Emitted:
  """The target reads `last_token` [B]; the next token is sampled and
  emitted into `tokens` [B, W] (`buffers.emit`) for rows not `done` [B].
  `params` carries the controls' history through `last_token`."""
  start = cache.lengths
  out, cache = target(last_token[:, None], cache)  # [B, 1] -> [B, 1, V]
  out = model_output(out)
  probs = sampling.probabilities(out.logits[:, 0], params)  # [B, V]
  token = sampling.sample(key, probs)
  # Done rows do not advance, so they never run past the cache.
  cache = cache.rollback(jnp.where(done, start, cache.lengths))
  tokens, new_counts, new_done, stop_state = buffers.emit(
      tokens, counts, done, token[:, None], jnp.ones_like(counts), eos_ids,
      max_new_tokens, stops, stop_state)
  return Emitted(token=token, probs=probs, out=out, cache=cache,
                 tokens=tokens, counts=new_counts, done=new_done,
                 stop_state=stop_state, params=params.advance(token, ~done))


def plain_run(state: SpecState, steps: jax.Array, *, target: LanguageModel,
              drafter: Drafter, params: StepParams, policy: PlainRuns,
              max_new_tokens: int | jax.Array, stream_id: Any = None
              ) -> SpecState:
  """Up to `steps` ([] int32, 0 for none; at most `LONGEST_PLAIN_RUN`)
  plain steps, fewer if a row ends first (the policy's choice reads which
  rows are active).

  Each step is `target_step`, and the drafter's `commit` of the token (a
  `Verification` of width 1, no draft accepted) as `speculate_step` would
  make it; a drafter that `commits_text` commits the run's tokens after
  it instead, G + 1 at a time (`commit_text`). The statistics
  (`SpecStats.plain`) and the policy (`PlainRuns.after_plain`) count
  the steps once, after the run.
  """
  steps = jnp.minimum(steps, LONGEST_PLAIN_RUN)
  batch = state.done.shape[0]
  done_before = state.done
  nothing = _nothing(batch, policy.max_gamma)
  deferred = drafter.commits_text

  def step(carry):
    taken, s = carry
    key, sample_key = jax.random.split(s.key)
    e = target_step(target, s.target_cache, s.last_token,
                    params.sampling.replace(controls=s.controls), sample_key,
                    s.tokens, s.num_generated, s.done, params.eos_ids,
                    max_new_tokens, params.stops, s.stop_state)
    drafter_state = s.drafter_state
    if not deferred:
      drafter_state = drafter.commit(drafter_state, nothing, Verification(
          num_accepted=jnp.zeros_like(e.token), next_token=e.token,
          emitted=e.token[:, None], logits=e.out.logits,
          probs=e.probs[:, None], hidden=e.out.hidden), ~s.done)
    streaming.deliver(stream_id, e.tokens, s.num_generated, e.counts, 1)
    return taken + 1, s.replace(
        tokens=e.tokens, num_generated=e.counts, done=e.done,
        stop_state=e.stop_state, controls=e.params.controls,
        last_token=e.token, target_cache=e.cache,
        drafter_state=drafter_state, key=key)

  def going(carry):
    taken, s = carry
    return (taken < steps) & jnp.all(s.done == done_before)

  taken, after = jax.lax.while_loop(going, step, (jnp.int32(0), state))
  ran = after.num_generated - state.num_generated  # [B]
  if deferred:
    after = after.replace(drafter_state=commit_text(
        drafter, after.drafter_state, after.tokens, state.num_generated,
        ran, policy.max_gamma + 1))
  return after.replace(stats=after.stats.plain(ran, taken),
                       policy_state=policy.after_plain(after.policy_state,
                                                       taken))


def commit_text(drafter: Drafter, drafter_state: Any, tokens: jax.Array,
                start: jax.Array, count: jax.Array, width: int) -> Any:
  """Commits each row's `count` [B] tokens of the output buffer `tokens`
  [B, W] from `start` [B] into a drafter that `commits_text`, `width`
  tokens at a time (the widest step's, for which the drafter's buffers
  have room)."""
  nothing = _nothing(tokens.shape[0], width - 1)

  def piece(carry):
    done, state = carry
    num = jnp.clip(count - done, 0, width)  # [B]
    emitted = text.window(tokens, start + done, width)  # [B, width]
    last = jnp.take_along_axis(emitted, jnp.maximum(num - 1, 0)[:, None],
                               axis=1)[:, 0]
    verification = Verification(
        num_accepted=num - 1, next_token=last, emitted=emitted,
        logits=None, probs=None)
    return done + width, drafter.commit(state, nothing, verification,
                                        num > 0)

  _, drafter_state = jax.lax.while_loop(
      lambda c: c[0] < jnp.max(count), piece, (jnp.int32(0), drafter_state))
  return drafter_state


def _nothing(batch: int, gamma: int) -> Proposal:
  """What `commit` is told was proposed at a plain step: nothing, in a
  chain's shape."""
  return Proposal(tokens=jnp.zeros((batch, gamma), jnp.int32),
                  num_drafted=jnp.zeros((batch,), jnp.int32),
                  num_forwards=jnp.int32(0))
