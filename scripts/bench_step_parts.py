r"""Where a fixed-γ step's time goes: its stages against its forwards.

The cost model (`specjax.policies.costs`) prices a step as the drafter's
forwards (a two-token catch-up pass, then γ - 1 one-token forwards) plus
the target's (γ+1)-token pass. This times, in one process and on random
weights at the real pair's shapes, one whole `speculate_step` (fixed γ,
synthetic acceptance `--alpha`, after two steps so the draft is in its
steady state), its two stages (`DraftModel.propose`, `verify`) jitted on
their own, and the bare forwards those stages run (`cost.forward_step`,
what the cost model measures). The stages here do not donate their
inputs, so each also copies the cache it writes, which the compiled loop
does not.

COMMAND:
  PYTHONPATH=. python scripts/bench_step_parts.py --batch=4 --gamma=4
"""

from __future__ import annotations

import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from specjax import acceptance
from specjax import decode
from specjax import loops
from specjax import policies
from specjax import drafters
from specjax import hardware
from specjax import speculate
from specjax import testing
from specjax.tuning import cost
from specjax.verify import verify

_BATCH = flags.DEFINE_integer("batch", 4, "Rows B.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Fixed γ.")
_ALPHA = flags.DEFINE_float("alpha", 0.95, "Synthetic acceptance.")
_TOKENS = flags.DEFINE_integer("tokens", 32, "New tokens per row.")
_PROMPT_TOKENS = flags.DEFINE_integer(
    "prompt_tokens", 128, "Prompt length with random weights.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per run.")


def main(argv):
  del argv
  batch, gamma = _BATCH.value, _GAMMA.value
  target = testing.random_model("qwen2.5-coder-1.5b-instruct", 0)
  draft = testing.random_model("qwen2.5-coder-0.5b-instruct", 1)
  drafter = drafters.DraftModel(draft)
  prompts = testing.random_prompts(batch, target.vocab_size,
                                   _PROMPT_TOKENS.value)
  size = decode.default_cache_size(_PROMPT_TOKENS.value, _TOKENS.value,
                                   reserve=gamma + 1)
  tokens, lengths, _ = decode.prepare_prompts(
      prompts, target.vocab_size, max_new_tokens=_TOKENS.value,
      cache_size=size)
  params = speculate.StepParams.create(
      acceptance=acceptance.Synthetic.create(_ALPHA.value))
  state = jax.jit(functools.partial(
      loops.init_spec_state, policy=policies.Fixed(gamma),
      max_new_tokens=_TOKENS.value,
      cache_size=size))(target, drafter, jnp.asarray(tokens),
                        jnp.asarray(lengths), params, jax.random.key(0))

  # Models and settings are arguments, not constants folded into the
  # programs.
  @jax.jit
  def step(target, drafter, params, state):
    return speculate.speculate_step(
        state, target=target, drafter=drafter, params=params,
        policy=policies.Fixed(gamma), max_new_tokens=_TOKENS.value)

  @jax.jit
  def propose(drafter, params, drafter_state, key):
    return drafter.propose(drafter_state, key, params.sampling, gamma,
                           params.stop_threshold)

  @jax.jit
  def check(target, params, cache, last_token, proposal, key):
    return verify(target, cache, last_token, proposal, params.sampling, key,
                  acceptance=params.acceptance)

  for _ in range(2):
    state = step(target, drafter, params, state)
  key = jax.random.key(3)
  proposal, _ = propose(drafter, params, state.drafter_state, key)
  parts = {
      "step": lambda: step(target, drafter, params, state),
      "propose": lambda: propose(drafter, params, state.drafter_state, key),
      "verify": lambda: check(target, params, state.target_cache,
                              state.last_token, proposal, key),
      "draft T=1": cost.forward_step(draft, prompts, size, 1),
      "draft T=2": cost.forward_step(draft, prompts, size, 2),
      f"target T={gamma + 1}": cost.forward_step(target, prompts, size,
                                                 gamma + 1),
  }
  ms = hardware.median_ms(parts, _REPEATS.value)
  # The drafter's forwards priced as the cost model prices them.
  drafting = policies.ForwardCosts(batch, {
      1: ms["draft T=1"], 2: ms["draft T=2"]}).drafting_ms(gamma)
  passing = ms[f"target T={gamma + 1}"]
  print(f"B={batch}, γ={gamma}, S={size}; {hardware.machine()}")
  for name, value in ms.items():
    print(f"{name}: {value:.1f} ms")
  print(f"propose {ms['propose']:.0f} ms against its forwards "
        f"{drafting:.0f} ({ms['propose'] / drafting:.2f}x); verify "
        f"{ms['verify']:.0f} against its forward {passing:.0f} "
        f"({ms['verify'] / passing:.2f}x); step {ms['step']:.0f} against "
        f"both {drafting + passing:.0f}")


if __name__ == "__main__":
  app.run(main)
