r"""The batch crossover: decoding tokens/s against B for every γ policy.

Runs autoregressive decoding, every fixed γ, transformers' heuristic and
`gamma="auto"` (cold, and warm from the run before) on the same prompts at
each B, and reports each policy's decoding tokens/s, `auto` over the best of
the others (pooled, paired per round, a bootstrap interval) and the cost
model's prediction beside each measurement (`experiments.crossover`).

COMMAND (the real pair, HumanEval chat prompts, the draft model drafting):
  python -m experiments.run --config=configs/crossover.py:batches=1/2/4 \
    --config.output_dir=/tmp/bench/crossover_real
COMMAND (random weights at the pair's shapes, SYNTHETIC acceptance):
  python -m experiments.run --config=configs/crossover.py:weights=random,\
batches=1/2/4/8/16/32,alphas=0.05/0.5/0.8/0.95 \
    --config.output_dir=/tmp/bench/crossover_random
One process holding every B's programs at the 1.5B shapes can run out of
memory on a small machine: run one B per process, then merge:
  python -m experiments.run --config=configs/crossover.py \
    --config.merge=DIR1,DIR2 --config.output_dir=/tmp/bench/cross_all
  (`--config.pool=True` joins the rounds of reruns of one cell)

Arguments: `weights=real|random`, `target=`, `draft=` (registry names, or
`tiny` for a smoke run), `drafter=model|lookup`, `batches=1/2/4`,
`gammas=1/2/4`, `max_gamma=4`, `alphas=` (random weights only), `tokens=32`,
`repeats=3`, `timings=1`, `keep=mean|fastest`, `refresh`, `prompt_tokens=128`,
`quantize=` ('' float32, `gguf`), `prompts=humaneval|mtbench`.
"""

from __future__ import annotations

import os
import sys

import ml_collections

try:
  import configs  # pylint: disable=g-import-not-at-top
except ImportError:  # Loaded by path from outside the repository root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  import configs  # pylint: disable=g-import-not-at-top


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The crossover config; see the module docstring for `arg`."""
  arg = configs.parse_arg(
      arg, weights="real", target="qwen2.5-coder-1.5b-instruct",
      draft="qwen2.5-coder-0.5b-instruct", drafter="model", batches="1/2/4",
      gammas="1/2/4", max_gamma=4, alphas="", tokens=32, repeats=3,
      timings=1, keep="mean", refresh=False, prompt_tokens=128,
      quantize="", prompts="humaneval")
  config = ml_collections.ConfigDict()
  # Which experiment `experiments.run` runs: this sweep.
  config.experiment = "crossover"
  # `real` checkpoints (`specjax.registry`), or `random` weights at their
  # shapes (`specjax.testing.random_model`), whose acceptance is synthetic.
  config.weights = arg["weights"]
  # Weights of both real models: '' (float32) or a `load_pretrained`
  # quantize mode (`gguf`: the GGUF blocks).
  config.quantize = arg["quantize"]
  # The real prompts' set (`experiments.prompts.PROMPT_SETS`); B beyond
  # its size repeats it.
  config.prompts = arg["prompts"]
  # Target and draft: registry names, or `tiny` (the random tiny pair).
  config.target = arg["target"]
  config.draft = arg["draft"]
  # `model` drafts with the draft model, `lookup` with prompt lookup.
  config.drafter = arg["drafter"]
  # Batch sizes B, one row of the table each.
  config.batch_sizes = configs.parse_ints(arg["batches"], "batches")
  # Fixed γ values run beside the policies.
  config.gammas = configs.parse_ints(arg["gammas"], "gammas")
  # γ_max of `auto` and the heuristic.
  config.max_gamma = arg["max_gamma"]
  # Synthetic acceptance rates α (random weights only); empty: real
  # verification.
  config.alphas = tuple(float(a) for a in arg["alphas"].split("/") if a)
  # New tokens per row (EOS ignored: every row does the same work).
  config.max_new_tokens = arg["tokens"]
  # Timed rounds over all policies, each in its own shuffled order.
  config.repeats = arg["repeats"]
  # Timings of each policy per round (one pass over the policies each),
  # reduced by `keep`: `mean` (what a user gets) or `fastest` (the least
  # disturbed).
  config.timings = arg["timings"]
  config.keep = arg["keep"]
  # Measure the forward costs afresh at each B's start.
  config.refresh_costs = arg["refresh"]
  # Prompt length with random weights.
  config.prompt_tokens = arg["prompt_tokens"]
  # Output dirs of earlier runs, comma-separated, to join into one table
  # and plot (runs nothing); `pool` joins the rounds of reruns of one
  # (α, B) cell instead of keeping the last run's.
  config.merge = ""
  config.pool = False
  # specjax cache root for weights ('' = $SPECJAX_CACHE or ~/.cache/specjax).
  config.cache_dir = ""
  # Persistent XLA compilation cache of the entry point (`auto`: under the
  # specjax cache; '' disables it).
  config.jax_cache_dir = "auto"
  # Where crossover.json and crossover.png go.
  config.output_dir = "/tmp/specjax/crossover"
  config.lock()
  return config
