"""Multi-host runs: `jax.distributed` set up once, output from one process.

Every process runs the same program on the same inputs (SPMD); a mesh from
`make_mesh` then spans every process's devices, parameters and prompts are
assembled from each process's own shards (`place.global_array`), and
results are gathered back (`place.host`). On CPU, cross-process collectives
go through gloo.

Launching two processes on one machine (what tests/test_distributed.py
does):

  python -m experiments.run --config=configs/tiny_pair.py:mesh=2x1 \
      --coordinator_address=localhost:12345 --num_processes=2 --process_id=0 &
  python -m experiments.run --config=configs/tiny_pair.py:mesh=2x1 \
      --coordinator_address=localhost:12345 --num_processes=2 --process_id=1

On a TPU pod slice or a GPU cluster with a scheduler JAX understands
(SLURM, Open MPI), pass `--num_processes=-1` and JAX finds the rest.
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str = "", num_processes: int = 1,
               process_id: int = 0) -> None:
  """Joins this process to a multi-process run (no-op for one process).

  Args:
    coordinator_address: "host:port" of process 0's coordinator.
    num_processes: processes in the run; 1 runs alone; -1 lets JAX detect
      the cluster (TPU pods, SLURM, Open MPI) and ignores the other two.
    process_id: this process's index in [0, num_processes).

  Raises:
    ValueError: an inconsistent combination, naming it.
  """
  if num_processes == 1:
    return
  if num_processes == -1:
    jax.distributed.initialize()
    return
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} is not in [0, "
                     f"num_processes={num_processes}).")
  if not coordinator_address:
    raise ValueError("A multi-process run needs coordinator_address "
                     "(host:port of process 0).")
  if jax.config.jax_platforms in (None, "", "cpu"):
    # Collectives between CPU processes (no effect on accelerators).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)


def is_main() -> bool:
  """Whether this process prints and writes results (process 0)."""
  return jax.process_index() == 0
