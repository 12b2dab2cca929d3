"""What machine this is, and how to time code on it.

Speed figures and tuning decisions depend on the CPU: they are recorded and
cached under `machine_key()`, which names the CPU (`cpu_id`: its model name,
and its family, model and SIMD extensions, since under a hypervisor one name
such as "AMD EPYC" covers Zen 1 to Zen 4), the core count and the JAX
version. Timings are medians of calls interleaved round-robin, so
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
import jax.numpy as jnp

__all__ = ["cpu_id", "cpu_model", "default_dtype", "machine", "machine_key",
           "median_ms", "resolve_dtype"]

# SIMD extensions that change which code is fastest, or which code runs.
_SIMD = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def default_dtype() -> jnp.dtype:
  """The parameter and cache dtype of `dtype="auto"`: bfloat16 on GPU and
  TPU, float32 on CPU (XLA CPU bf16 matmuls ran ~25x slower than fp32).
  Attention logits, softmax and the sampler's probabilities are fp32 in
  either (`specjax.models.transformer`, `specjax.sampling`)."""
  return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu"
                   else jnp.bfloat16)


def resolve_dtype(dtype: Any) -> jnp.dtype:
  """A dtype argument: None or "auto" is `default_dtype()`, anything else
  `jnp.dtype(dtype)` (a clear error for a name that is not a float
  dtype)."""
  if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
    return default_dtype()
  try:
    resolved = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"dtype must be 'auto' or a float dtype such as "
                     f"'bfloat16' or 'float32', got {dtype!r}.") from e
  if not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(f"dtype must be a float dtype, got {dtype!r}.")
  return resolved


@functools.cache
def _cpuinfo() -> dict[str, str]:
  """The first processor's fields in /proc/cpuinfo ({} where there is
  none)."""
  fields = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if not line.strip():
          break
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
  except OSError:
    pass
  return fields


def cpu_model() -> str:
  """The CPU's model name (as `lscpu` prints it), or the platform's."""
  return (_cpuinfo().get("model name") or platform.processor()
          or platform.machine())


def _cpu_flags() -> frozenset[str]:
  return frozenset(_cpuinfo().get("flags", "").split())


def _simd() -> list[str]:
  flags = _cpu_flags()
  return [f for f in _SIMD if f in flags]


@functools.cache
def cpu_id() -> str:
  """The CPU as caches must tell it apart: model name, family, model and
  SIMD extensions (e.g. "AMD EPYC (family 23 model 1; avx2)")."""
  info = _cpuinfo()
  detail = [f"{k.split()[-1]} {info[k]}" for k in ("cpu family", "model")
            if k in info]
  detail = "; ".join(filter(None, [" ".join(detail), ",".join(_simd())]))
  return f"{cpu_model()} ({detail})" if detail else cpu_model()


def machine() -> dict[str, Any]:
  """A JSON-ready description to record next to every figure."""
  return {
      "cpu_model": cpu_model(),
      "cpu_id": cpu_id(),
      "cpu_simd": _simd(),
      "cpu_count": os.cpu_count(),
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }


def machine_key() -> str:
  """A key for caches of measurements: CPU, cores, backend and JAX."""
  return (f"{cpu_id()}|cores={os.cpu_count()}|"
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
