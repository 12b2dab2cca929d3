r"""Runs one speculative-decoding experiment from an ml-collections config.

COMMAND: python -m experiments.run --config=configs/llama_pair.py
  (smoke: --config=configs/tiny_pair.py --config.output_dir=/tmp/x;
  sweeps: --config.gammas=1,2,4,8 --config.batch_sizes=1,2,4,8;
  the policies' batch crossover: --config=configs/crossover.py)

Prints a table and writes results.json and plots into config.output_dir. All
the work is in `experiments.bench.run_experiment` (or, for a config with
`experiment = "crossover"`, `experiments.crossover.run`), which notebooks
call too.

Multi-process (`specjax.sharding.distributed`): every process runs this
command with the same config (`mesh=` spanning all their devices) plus
`--coordinator_address=host:port --num_processes=P --process_id=i`;
process 0 prints and writes the results.
"""

from __future__ import annotations

import os

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from experiments import bench
from experiments import crossover
from experiments import report
from specjax.sharding import distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/llama_pair.py", "Experiment config file.",
    lock_config=True)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "host:port of process 0, for a multi-process "
    "run (jax.distributed).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", 1, "Processes in the run (1: alone; -1: detected from "
    "the cluster, TPU pods and SLURM).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", 0, "This process's index in [0, num_processes).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  if config.get("experiment") == "crossover":
    jax.config.update("jax_compilation_cache_dir",
                      bench.jax_cache_dir(config))
    try:
      results = crossover.run(config)
    except bench.ConfigError as e:
      raise app.UsageError(str(e)) from None
    print(crossover.table(results))
    print(f"wrote {config.output_dir}/crossover.json, crossover.png")
    return
  try:
    bench.validate_config(config)  # Before any loading or compilation.
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value)
  except (bench.ConfigError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  logging.info("Config:\n%s", config)
  # specjax.decode turned the persistent cache on at import; the config
  # may move it or turn it off ('').
  jax.config.update("jax_compilation_cache_dir", bench.jax_cache_dir(config))
  results = bench.run_and_save(config)
  if not distributed.is_main():
    return  # process 0 prints and writes
  print(report.format_report(results), flush=True)
  for name in [report.RESULTS_FILE] + results.get("plots", []):
    print(f"wrote {os.path.join(config.output_dir, name)}")


if __name__ == "__main__":
  app.run(main)
