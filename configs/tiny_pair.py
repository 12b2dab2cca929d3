r"""Smoke run: random tiny target and draft, byte-level stand-in tokenizer.

Exercises the whole experiment (prompts, warm-up, baseline, speculative
decoding, losslessness check, cost ratio, table, results.json, plots) in
well under a minute on CPU. The models are random, so α ≈ 0 and the speedups
mean nothing; with `draft=same` the target drafts for itself (α = 1).

COMMAND: python -m experiments.run --config=configs/tiny_pair.py \
  --config.output_dir=/tmp/specjax/tiny

Arguments: `gamma=3`, `gammas=2/3` (sweep), `batch=2`, `batches=1/2`,
`draft=same`, `n=4`, `tokens=16`, `mesh=2x1` (`specjax.sharding`; with
`XLA_FLAGS=--xla_force_host_platform_device_count=2`, or two processes:
`specjax.sharding.distributed`).
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
from configs import llama_pair  # pylint: disable=g-import-not-at-top


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The tiny smoke config; see the module docstring for `arg`."""
  arg = configs.parse_arg(arg, gamma=3, gammas="", batch=2, batches="",
                          draft="tiny", n=4, tokens=16, mesh="")
  config = llama_pair.get_config(
      f"pair=tiny,gamma={arg['gamma']},gammas={arg['gammas']},"
      f"batch={arg['batch']},batches={arg['batches']},n={arg['n']},"
      f"tokens={arg['tokens']},dtype=float32,mesh={arg['mesh']}")
  # Fields below override llama_pair's; each is documented there.
  config.draft = arg["draft"]  # `tiny` (random) or `same` (the target).
  config.prompt_set = "code"  # built in: no wheel download
  config.max_prompt_tokens = 32  # one prompt bucket: fewer compilations
  config.timing_repeats = 2  # cheap, so take a median of two
  config.cost_repeats = 20  # tiny forwards take ~0.1 ms; dispatch dominates
  config.save_text = False  # byte-level text of random models is noise
  config.output_dir = "/tmp/specjax/tiny_pair"  # where results go
  return config
