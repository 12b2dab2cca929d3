"""TPU targets to compile for with no TPU attached, and their datasheets.

`jax.experimental.topologies.get_topology_desc` gives compile-only devices
of a TPU slice once libtpu is installed (`pip install "specjax[tpu]"`) and
told it runs alone (`environment`). libtpu reads that environment once per
process, so each chip kind is compiled for in a process of its own
(`scripts/aot_report.py` runs one per chip).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.experimental import topologies

from specjax.policies.costs import Roofline
from specjax.sharding import memory

__all__ = ["CHIPS", "Chip", "attached", "devices", "environment"]


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation.

  Attributes:
    name: "v5e" or "v6e".
    accelerator_type: the `TPU_ACCELERATOR_TYPE` of a 4-chip host.
    hbm_bytes: HBM per chip.
    bandwidth: HBM bytes per second per chip.
    bf16_flops: peak bf16 FLOP/s per chip.
  """

  name: str
  accelerator_type: str
  hbm_bytes: int
  bandwidth: float
  bf16_flops: float

  def topology(self, chips: int) -> str:
    """A topology name holding `chips` (1, 4 or 8) chips: one 2x2 host, or
    two."""
    return f"{self.name}:{'2x4' if chips > 4 else '2x2'}"


# Google Cloud's published figures per chip.
CHIPS = {
    "v5e": Chip("v5e", "v5litepod-4", 16 * 2**30, 819e9, 197e12),
    "v6e": Chip("v6e", "v6e-4", 32 * 2**30, 1640e9, 918e12),
}


def environment(chip: Chip) -> dict[str, str]:
  """The variables libtpu needs to compile for `chip` on a machine with no
  TPU (set before JAX first loads the TPU plugin)."""
  return {"TPU_SKIP_MDS_QUERY": "1",
          "TPU_ACCELERATOR_TYPE": chip.accelerator_type,
          "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
          # No lock: other processes may hold libtpu (it compiles only).
          "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def devices(chip: Chip, chips: int) -> list:
  """`chips` compile-only devices of `chip`.

  Raises:
    RuntimeError: libtpu is not installed, or the process's environment
      was set for another chip.
  """
  for key, value in environment(chip).items():
    os.environ.setdefault(key, value)
  if os.environ["TPU_ACCELERATOR_TYPE"] != chip.accelerator_type:
    raise RuntimeError(
        f"This process compiles for {os.environ['TPU_ACCELERATOR_TYPE']}; "
        f"compile for {chip.name} in a process of its own.")
  try:
    topology = topologies.get_topology_desc(
        topology_name=chip.topology(chips), platform="tpu")
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        "Compiling for TPU needs libtpu: pip install \"specjax[tpu]\" "
        f"({type(e).__name__}: {e}).") from e
  return list(topology.devices)[:chips]


def attached(chips: int = 1) -> tuple[Chip, list]:
  """This runtime's own first `chips` devices and a datasheet for them:
  their memory as JAX reports it, their nominal bandwidth and FLOP rate
  (`specjax.policies.Roofline.nominal`)."""
  devices = jax.devices()[:chips]
  nominal = Roofline.nominal()
  kind = devices[0].device_kind
  return Chip(kind, kind, memory.device_memory(devices[0]) or 0,
              nominal.bandwidth, nominal.flops), devices
