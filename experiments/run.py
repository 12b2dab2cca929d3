r"""Runs one speculative-decoding experiment from an ml-collections config.

COMMAND: python -m experiments.run --config=configs/llama_pair.py
  (smoke: --config=configs/tiny_pair.py --config.output_dir=/tmp/x;
  sweeps: --config.gammas=1,2,4,8 --config.batch_sizes=1,2,4,8)

Prints a table and writes results.json and plots into config.output_dir. All
the work is in `experiments.bench.run_experiment`, which notebooks call too.
"""

from __future__ import annotations

import os

from absl import app
from absl import logging
import jax
from ml_collections import config_flags

from experiments import bench
from experiments import report

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/llama_pair.py", "Experiment config file.",
    lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  try:
    bench.validate_config(config)  # Before any loading or compilation.
  except bench.ConfigError as e:
    raise app.UsageError(str(e)) from None
  logging.info("Config:\n%s", config)
  # specjax.decode turned the persistent cache on at import; the config
  # may move it or turn it off ('').
  jax.config.update("jax_compilation_cache_dir", bench.jax_cache_dir(config))
  results = bench.run_and_save(config)
  print(report.format_report(results), flush=True)
  for name in [report.RESULTS_FILE] + results.get("plots", []):
    print(f"wrote {os.path.join(config.output_dir, name)}")


if __name__ == "__main__":
  app.run(main)
