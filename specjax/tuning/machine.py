"""The machine's roofline: memory bandwidth and matmul throughput, measured.

`measure_roofline` times a large-array read (`tuning.cost.read_step`) and a
square float32 matrix product once, and caches them per machine
(`<cache>/tuning/machine.json`), where `policies.Roofline.cached` reads
them (`policies.measured.machine_rates`) to price forwards that no table
covers.
"""

from __future__ import annotations

import datetime
import os

import jax
import jax.numpy as jnp

from specjax import hardware
from specjax import store
from specjax.policies.costs import Roofline
from specjax.policies.measured import check_machine
from specjax.tuning.cost import READ_BYTES
from specjax.tuning.cost import read_step

__all__ = ["measure_roofline"]

_GEMM = 2048


def measure_roofline(repeats: int = 5,
                     cache_dir: str | os.PathLike | None = None
                     ) -> Roofline:
  """Times this machine's bandwidth and FLOP rate and caches them."""
  a = jnp.ones((_GEMM, _GEMM), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  ms = hardware.median_ms({"read": read_step(), "gemm": lambda: matmul(a)},
                          repeats)
  nominal = Roofline.nominal()
  result = Roofline(bandwidth=READ_BYTES / (ms["read"] / 1e3),
                    flops=2.0 * _GEMM ** 3 / (ms["gemm"] / 1e3),
                    overhead_ms=nominal.overhead_ms, source="measured")
  path = store.path_for("machine", cache_dir)
  entries = store.read(path, check_machine)
  entries[hardware.machine_key()] = {
      "bandwidth": result.bandwidth, "flops": result.flops,
      "overhead_ms": result.overhead_ms,
      "measured": datetime.datetime.now().isoformat(timespec="seconds")}
  store.write(path, entries)
  return result
