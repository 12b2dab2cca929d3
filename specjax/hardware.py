"""What machine this is, and how to time code on it.

Speed figures and tuning decisions depend on the CPU: they are recorded and
cached under `machine_key()`, which names the CPU model, the core count and
the JAX version. Timings are medians of calls interleaved round-robin, so
load changes on a shared machine spread over every candidate instead of
biasing whichever ran during a busy spell.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping

import jax

__all__ = ["cpu_model", "machine", "machine_key", "median_ms"]


@functools.cache
def cpu_model() -> str:
  """The CPU's model name (as `lscpu` prints it), or the platform's."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


@functools.cache
def _cpu_flags() -> frozenset[str]:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


def machine() -> dict[str, Any]:
  """A JSON-ready description to record next to every figure."""
  flags = _cpu_flags()
  simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                      "amx_tile") if f in flags]
  return {
      "cpu_model": cpu_model(),
      "cpu_simd": simd,
      "cpu_count": os.cpu_count(),
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }


def machine_key() -> str:
  """A key for caches of measurements: CPU, cores, backend and JAX."""
  return (f"{cpu_model()}|cores={os.cpu_count()}|"
          f"{jax.default_backend()}|jax={jax.__version__}")


def median_ms(steps: Mapping[str, Callable[[], Any]], repeats: int,
              warmup: int = 2) -> dict[str, float]:
  """Median milliseconds per call of each step, timed round-robin.

  Args:
    steps: name -> a function of no arguments returning arrays.
    repeats: timed calls per step.
    warmup: untimed calls per step first (compilation, page faults).

  Returns:
    name -> median ms.
  """
  for _ in range(warmup):
    for step in steps.values():
      jax.block_until_ready(step())
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step())
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}
