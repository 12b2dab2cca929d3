r"""Trains Medusa heads or an EAGLE layer on a target by self-distillation.

COMMAND: python -m experiments.train_heads --config=configs/train_heads.py
  (smoke: --config=configs/train_heads.py:target=tiny,steps=20,sequences=16
  --config.workdir=/tmp/heads_smoke)

Rerunning the same command resumes from the last orbax checkpoint. The work
is in `specjax.heads.pipeline.run`; the trained heads draft with
`python -m experiments.run --config=configs/llama_pair.py:drafter=medusa`
`--config.medusa_path=WORKDIR` (or `drafter=eagle`
`--config.eagle_path=WORKDIR`).
"""

from __future__ import annotations

import json

from absl import app
from absl import logging
from ml_collections import config_flags

from specjax.heads import pipeline

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/train_heads.py", "Training config file.",
    lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  logging.info("Config:\n%s", config)
  try:
    results = pipeline.run(config)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  summary = {k: v for k, v in results.items() if k != "history"}
  print(json.dumps(summary, indent=1), flush=True)
  print(f"wrote {config.workdir}/results.json, history and training.png")


if __name__ == "__main__":
  app.run(main)
