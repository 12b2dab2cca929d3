r"""What a plain step costs inside the speculative loop, against `generate`.

`gamma="auto"` can only be as fast as autoregressive decoding where it
stops drafting if its plain steps (a one-token target pass inside the
compiled speculative loop: `lax.cond` around drafting, `lax.switch` over
verification widths, the rejection sampler, statistics) cost what a step
of `generate` costs. This times both on the same prompts: `generate`, and
`speculative_generate` under an `Auto` policy whose prior is 0 (it drafts
nothing but a one-token probe every `probe_every` steps), with synthetic
acceptance; and, with `--fixed_gammas`, fixed-γ speculative decoding at
synthetic acceptance `--alpha` (what a drafting step costs); with
`--policy_path` also each such γ run through the adaptive policies' step
(`Heuristic` at γ_max = γ: the same drafts and width every step when
`--alpha=1`, so the difference is the cost of the policy's machinery).
Decoding-phase time: a one-token call's time (prompt pass and first token)
is subtracted, medians over `--repeats` rounds that interleave the runs.
With `--finish`, the plain steps again with the batch's end computed each
way (`Auto.serial_finish`); with `--count_ops`, the XLA operations each
run executes per decoding step (`profiling.executed_ops`): what a step
pays per operation where operations are small, as on a GPU.

COMMAND (random weights at the real pair's shapes):
  PYTHONPATH=. python scripts/bench_plain_step.py --batch=8 --tokens=32 \
    --prompt_tokens=64
COMMAND (the tiny pair: the loop's own operations against a tiny forward,
the batch's end computed in a loop and at once):
  PYTHONPATH=. python scripts/bench_plain_step.py --num_layers=-1 \
    --batch=1 --tokens=64 --prompt_tokens=16 --repeats=15 \
    --finish=serial,at_once --count_ops
COMMAND (one layer per model: the models' depth no longer hides the
loop's own per-step work, which grows with B and the vocabulary):
  PYTHONPATH=. python scripts/bench_plain_step.py --batch=32 --tokens=32 \
    --prompt_tokens=16 --num_layers=1
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import numpy as np

from specjax import policies as policies_lib
from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import profiling
from specjax import testing

_BATCH = flags.DEFINE_integer("batch", 8, "Rows B.")
_FIXED = flags.DEFINE_list("fixed_gammas", [], "Fixed γ runs to add (e.g. 4).")
_ALPHA = flags.DEFINE_float("alpha", 0.8,
                            "Synthetic acceptance of the fixed-γ runs.")
_LAYERS = flags.DEFINE_integer(
    "num_layers", 0, "Layers of both models (0: the pair's own; -1: the "
    "tiny random pair of the tests instead).")
_POLICY_PATH = flags.DEFINE_bool(
    "policy_path", False, "Also run each fixed γ as Heuristic(γ).")
_FINISH = flags.DEFINE_list(
    "finish", [], "Also the plain steps with the batch's end computed "
    "'serial' or 'at_once' (default: by the backend).")
_COUNT_OPS = flags.DEFINE_bool(
    "count_ops", False, "Count the XLA operations per decoding step.")
_TOKENS = flags.DEFINE_integer("tokens", 32, "New tokens per row.")
_PROMPT_TOKENS = flags.DEFINE_integer(
    "prompt_tokens", 128, "Prompt length with random weights.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per run.")


def _decode_s(runs: dict, tokens: int, repeats: int) -> dict[str, float]:
  """Per run, the median seconds of fn(tokens) minus the median of fn(1),
  the runs interleaved round by round (a noisy machine's slow spells fall
  on all of them alike)."""
  for fn in runs.values():
    for n in (tokens, 1):  # compile both shapes first
      jax.block_until_ready(fn(n).tokens)
  times = {(name, n): [] for name in runs for n in (tokens, 1)}
  for _ in range(repeats):
    for name, fn in runs.items():
      for n in (tokens, 1):
        start = time.perf_counter()
        jax.block_until_ready(fn(n).tokens)
        times[name, n].append(time.perf_counter() - start)
  return {name: float(np.median(times[name, tokens])
                      - np.median(times[name, 1])) for name in runs}


def _ops_per_step(runs: dict, tokens: int) -> dict[str, float]:
  """Per run, the operations of fn(tokens) minus those of fn(1), per
  decoding step."""
  return {name: (profiling.executed_ops(lambda f=fn: f(tokens).tokens)
                 - profiling.executed_ops(lambda f=fn: f(1).tokens))
          / (tokens - 1) for name, fn in runs.items()}


def main(argv):
  del argv
  if _LAYERS.value < 0:
    target, draft = testing.tiny_pair(0)
  else:
    target = testing.random_model("qwen2.5-coder-1.5b-instruct", 0,
                                  _LAYERS.value)
    draft = testing.random_model("qwen2.5-coder-0.5b-instruct", 1,
                                 _LAYERS.value)
  batch = _BATCH.value
  prompts = testing.random_prompts(batch, target.vocab_size,
                                   _PROMPT_TOKENS.value)
  size = decode.default_cache_size(_PROMPT_TOKENS.value, _TOKENS.value,
                                   reserve=5)
  # Costs do not matter at prior 0: no draft ever predicts a gain.
  plain = {"": policies_lib.Auto.create(
      max_gamma=4, target_ms=[1.0, 1.2, 1.4, 1.8], draft_ms=0.3, prior=0.0)}
  for way in _FINISH.value:
    if way not in ("serial", "at_once"):
      raise app.UsageError(f"--finish takes serial or at_once, not {way!r}.")
    plain[f", finish={way}"] = plain[""].replace(
        serial_finish=way == "serial")
  runs = {"generate": lambda n: decode.generate(target, prompts,
                                                max_new_tokens=n,
                                                cache_size=size)}
  for label, policy in plain.items():
    runs[f"speculative, plain steps{label}"] = (
        lambda n, p=policy: decode.speculative_generate(
            target, drafters.DraftModel(draft), prompts, gamma=p,
            max_new_tokens=n, cache_size=size, synthetic_acceptance=0.05,
            key=0))
  for gamma in map(int, _FIXED.value):
    policies = {"gamma": gamma}
    if _POLICY_PATH.value:
      policies["heuristic, gamma_max"] = policies_lib.Heuristic(gamma)
    for label, policy in policies.items():
      runs[f"speculative, {label}={gamma}, alpha={_ALPHA.value}"] = (
          lambda n, p=policy: decode.speculative_generate(
              target, drafters.DraftModel(draft), prompts, gamma=p,
              max_new_tokens=n, cache_size=size,
              synthetic_acceptance=_ALPHA.value, key=0))
  steps = _TOKENS.value - 1
  print(f"B={batch}, S={size}, {steps} decoding steps; {hardware.machine()}")
  decoding = _decode_s(runs, _TOKENS.value, _REPEATS.value)
  ops = _ops_per_step(runs, _TOKENS.value) if _COUNT_OPS.value else {}
  base = decoding["generate"]
  for name, seconds in decoding.items():
    counted = f", {ops[name]:.0f} ops/step" if name in ops else ""
    print(f"{name}: {seconds / steps * 1e3:.3f} ms/step, "
          f"{batch * steps / seconds:.2f} tokens/s, "
          f"{base / seconds:.3f}x generate{counted}", flush=True)


if __name__ == "__main__":
  app.run(main)
