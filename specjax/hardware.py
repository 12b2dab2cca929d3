"""What machine this is, what its devices can do, and how to time code.

Speed figures and tuning decisions depend on the CPU: they are recorded and
cached under `machine_key()`, which names the CPU (`cpu_id`: its model name,
and its family, model and SIMD extensions, since under a hypervisor one name
such as "AMD EPYC" covers Zen 1 to Zen 4), the core count and the JAX
version. `machine()` is the one record written next to every figure (CPU,
cores, JAX, backend and devices, XLA flags, and the commit the code came
from). `nominal_rates()` is what a device can do by its data sheet, for a
machine nothing has measured.

Timing, for every benchmark and tuning step: `median_ms` times steps
interleaved round-robin, so load changes on a shared machine spread over
every candidate instead of biasing whichever ran during a busy spell (and,
with `settle`, each right after a call of its own, as a loop runs it);
`looped_ms` times one more iteration of a step's compiled loop, as a
generation pays it;
`settled_ms` repeats such passes, one candidate's steps at a time, until
two agree and keeps each step's least, for one-time choices;
`timed_call` times a whole generate call as a user runs it, and its
prefill alone (or the moment its first token streams out), so the decoding
phase can be reported apart.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Call", "DATASHEETS", "LOOPED", "TIMED", "agree_ms", "cpu_id",
           "cpu_model", "cpu_simd", "default_dtype", "looped_ms", "machine",
           "machine_key", "median_ms", "nominal_rates", "num_cores",
           "resolve_dtype", "settled_ms", "source_version", "timed_call",
           "warm_up"]

# SIMD extensions that change which code is fastest, or which code runs.
_SIMD = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")

# (device kind, memory bandwidth B/s, bf16 peak FLOP/s), from vendors'
# data sheets.
DATASHEETS = (
    ("H200", 4.8e12, 989e12), ("H100", 3.35e12, 989e12),
    ("A100", 2.0e12, 312e12), ("L4", 3.0e11, 121e12),
    ("T4", 3.2e11, 65e12), ("V100", 9.0e11, 125e12),
    ("v5 lite", 8.19e11, 197e12), ("v5e", 8.19e11, 197e12),
    ("v5p", 2.76e12, 459e12), ("v6", 1.64e12, 918e12),
    ("v4", 1.2e12, 275e12), ("v3", 9.0e11, 123e12), ("v2", 7.0e11, 46e12),
)


def default_dtype() -> jnp.dtype:
  """The parameter and cache dtype of `dtype="auto"`: bfloat16 on GPU and
  TPU, float32 on CPU (XLA CPU's bf16 matmuls are far slower there).
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


def cpu_simd() -> list[str]:
  """The SIMD extensions of `_SIMD` this CPU has."""
  flags = _cpu_flags()
  return [f for f in _SIMD if f in flags]


@functools.cache
def cpu_id() -> str:
  """The CPU as caches must tell it apart: model name, family, model and
  SIMD extensions (e.g. "AMD EPYC (family 23 model 1; avx2)")."""
  info = _cpuinfo()
  detail = [f"{k.split()[-1]} {info[k]}" for k in ("cpu family", "model")
            if k in info]
  detail = "; ".join(filter(None, [" ".join(detail),
                                   ",".join(cpu_simd())]))
  return f"{cpu_model()} ({detail})" if detail else cpu_model()


def num_cores() -> int:
  """CPU cores this process may use."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def source_version(path: str | None = None) -> str | None:
  """The commit the code at `path` (default: this package) came from, as
  `git describe --always --dirty` writes it ("-dirty" when the tree has
  uncommitted changes), or None outside a git checkout (an installed
  wheel)."""
  try:
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True,
        text=True, check=True, timeout=10,
        cwd=path or os.path.dirname(os.path.abspath(__file__)))
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


def machine() -> dict[str, Any]:
  """A JSON-ready description to record next to every figure: the CPU,
  the cores this process may use, JAX, its backend and devices, the XLA
  flags and the commit (`source_version`)."""
  devices = jax.devices()
  return {
      "cpu_model": cpu_model(),
      "cpu_id": cpu_id(),
      "cpu_simd": cpu_simd(),
      "cpu_count": os.cpu_count(),
      "cpu_cores": num_cores(),
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "platform": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "devices": [str(d) for d in devices],
      "num_devices": len(devices),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "source": source_version(),
  }


def nominal_rates() -> dict[str, float]:
  """This backend's device by nominal figures, needing no timing: memory
  bandwidth (B/s), float32 FLOP/s and a fixed per-forward overhead (ms),
  the keywords of `specjax.policies.Roofline`.

  On GPU and TPU, `DATASHEETS` by device kind, float32 at half the bf16
  peak (TF32); on CPU, below what machines measure, 10 GB/s
  and, with AVX-512 (AVX2), 100 (50) GFLOP/s per core
  (`specjax.tuning.machine` measures them).
  """
  if jax.default_backend() == "cpu":
    cores = os.cpu_count() or 1
    simd = cpu_simd()
    per_core = 100e9 if "avx512f" in simd else (
        50e9 if "avx2" in simd else 10e9)
    return {"bandwidth": min(10e9 * cores, 200e9),
            "flops": per_core * cores, "overhead_ms": 0.05}
  kind = jax.devices()[0].device_kind
  for name, bandwidth, peak in DATASHEETS:
    if name.lower() in kind.lower():
      return {"bandwidth": bandwidth, "flops": peak / 2, "overhead_ms": 0.2}
  return {"bandwidth": 1e12, "flops": 50e12, "overhead_ms": 0.2}


def machine_key() -> str:
  """A key for caches of measurements: CPU, cores, backend and JAX."""
  return (f"{cpu_id()}|cores={os.cpu_count()}|"
          f"{jax.default_backend()}|jax={jax.__version__}")


# How the tuning steps time a step, part of the keys of the measurements
# they cache (a measurement timed otherwise is not read): one-time choices
# each step right after a call of its own (`settled_ms`), forward tables
# as one more iteration of a compiled loop (`looped_ms`).
TIMED = "each-after-itself"
LOOPED = "one-more-in-a-loop"
# `looped_ms` times at least this long a difference of two calls.
_LOOP_MS = 20.0


def median_ms(steps: Mapping[str, Callable[[], Any]], repeats: int,
              warmup: int = 2, settle: int = 0) -> dict[str, float]:
  """Median milliseconds per call of each step, timed round-robin.

  Args:
    steps: name -> a function of no arguments returning arrays.
    repeats: timed calls per step.
    warmup: untimed calls per step first (compilation, page faults).
    settle: untimed calls of a step right before each of its timed ones,
      so that it is timed as a run of its own calls runs, not right after
      another step: on a 2-core CPU a one-token forward of the 1.5B blocks
      at B = 8 takes 120 ms after itself and 160 ms after a five-token
      one.

  Returns:
    name -> median ms.
  """
  for _ in range(warmup):
    for step in steps.values():
      jax.block_until_ready(step())
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      for _ in range(settle):
        jax.block_until_ready(step())
      start = time.perf_counter()
      jax.block_until_ready(step())
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def looped_ms(steps: Mapping[Any, Callable[[int], Any]], repeats: int,
              warmup: int = 1) -> dict[Any, float]:
  """Median ms of one more iteration of each step's compiled loop.

  A generation runs its forwards in one compiled loop, dispatched once,
  out of which XLA hoists what no iteration changes (a packed matrix
  dequantised for a product too wide for the kernel). A forward timed as
  a call of its own pays both every time (BENCHMARKS.md "Never slower"
  has what that cost). So each timing is (t(1 + k) - t(1)) / k,
  a call of 1 + k iterations less the call of 1 right before it, k such
  that k iterations take at least `_LOOP_MS`. A step's calls run back to
  back, after untimed ones of its own, so that no timed iteration follows
  another step's (a one-token forward right after a wider one runs
  slower, `median_ms`).

  Args:
    steps: name -> a function of n running n iterations in one call.
    repeats: timings per step.
    warmup: untimed calls of each step(1) first (compilation).

  Returns:
    name -> median ms of an iteration (at least 1e-6: a loop of a tiny
    model can cost less than the timings' noise).
  """
  def spans_ms(step, more):
    """ms of step(1), then of step(1 + more)."""
    spans = []
    for n in (1, 1 + more):
      start = time.perf_counter()
      jax.block_until_ready(step(n))
      spans.append(1e3 * (time.perf_counter() - start))
    return spans

  out = {}
  for name, step in steps.items():
    for _ in range(warmup):
      jax.block_until_ready(step(1))
    once, twice = spans_ms(step, 1)
    # An iteration's rough cost, not below 1% of a call's (a noisy
    # difference must not make k huge).
    more = int(np.ceil(_LOOP_MS / max(twice - once, once / 100)))
    spans = [spans_ms(step, more) for _ in range(repeats)]
    out[name] = max(statistics.median((b - a) / more for a, b in spans),
                    1e-6)
  return out


def agree_ms(a: Mapping[Any, float], b: Mapping[Any, float],
             tolerance: float) -> bool:
  """Whether every step's time in `a` is within `tolerance` (relative) of
  its time in `b`."""
  return all(abs(a[k] / b[k] - 1) <= tolerance for k in a)


def settled_ms(steps: Mapping[Any, Callable[[], Any]], repeats: int, *,
               group: Callable[[Any], Any] = lambda name: None,
               agree: float = 0.05, max_passes: int = 4) -> dict[Any, float]:
  """Each step's least median ms over passes, taken until two successive
  passes agree within `agree` at every step (at most `max_passes`).

  A one-time choice between candidates (a matmul plan, float or block
  weights) is cached and then decides every later run, so neither a slow
  moment of a shared machine nor one candidate's effect on the next must
  decide it:

  - a pass times each `group` of steps (steps named alike by `group`: one
    candidate's) round-robin by `median_ms`, the groups one after the
    other, each step right after an untimed call of its own (`settle`),
    so a step is never timed right after another's: on one 2-core Xeon a
    float product timed just after a block kernel's long product took
    1.6x its time alone;
  - time only adds to a step, so the least of settled passes is the
    estimate of what the machine does undisturbed.
  """
  if max_passes < 2:
    raise ValueError(f"max_passes must be >= 2, got {max_passes}.")
  groups: dict[Any, dict[Any, Callable[[], Any]]] = {}
  for name, step in steps.items():
    groups.setdefault(group(name), {})[name] = step

  def timed() -> dict[Any, float]:
    return {k: v for g in groups.values() for k, v in
            median_ms(g, repeats, settle=1).items()}

  passes = [timed(), timed()]
  while len(passes) < max_passes and not agree_ms(passes[-1], passes[-2],
                                                  agree):
    passes.append(timed())
  return {k: min(p[k] for p in passes) for k in steps}


@dataclasses.dataclass
class Call:
  """One timed generate call (`timed_call`).

  Attributes:
    output: the call's `GenerateOutput` or `SpecOutput`.
    seconds: its wall time, reduced over repeats (median by default).
    warmup_s: the untimed first calls (compilation and a run), 0 if warm.
    prefill_s: wall time of the same call with one new token, or (a
      streamed call) of the call until its first token reached the host.
  """

  output: Any
  seconds: float
  warmup_s: float
  prefill_s: float

  @property
  def decode_s(self) -> float:
    """Time of the decoding phase: everything after the first token."""
    return max(self.seconds - self.prefill_s, 0.0)

  @property
  def decode_tokens(self) -> int:
    return int(np.sum(np.maximum(self.output.lengths - 1, 0)))


def _time(fn: Callable[[], Any], repeats: int,
          summary: Callable[[list[float]], float]) -> tuple[float, Any]:
  """`summary` of `repeats` timings of fn() (seconds), and its first
  output."""
  times, out = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    result = fn()  # returns numpy arrays: the device work is done
    times.append(time.perf_counter() - start)
    out = result if out is None else out
  return summary(times), out


def warm_up(fn: Callable[..., Any], key: tuple, seen: set,
            streamed: bool = False) -> tuple[Any, float]:
  """Runs `fn()` and `fn(max_new_tokens=1)` once untimed (compilation) and
  records `key` in `seen`; returns fn()'s output and the seconds the
  calls took. `streamed`: fn() alone, streaming, as `timed_call` times
  it."""
  start = time.perf_counter()
  if streamed:
    out = fn(on_tokens=lambda _: None)
  else:
    out = fn()
    fn(max_new_tokens=1)
  seen.add(key)
  return out, time.perf_counter() - start


def _streamed(fn: Callable[..., Any]) -> tuple[float, float, Any]:
  """Runs `fn` streamed (`on_tokens`); returns its seconds, the seconds
  until the host received its first token, and its output."""
  first = []
  start = time.perf_counter()
  out = fn(on_tokens=lambda _: first or first.append(time.perf_counter()))
  return time.perf_counter() - start, first[0] - start, out


def timed_call(fn: Callable[..., Any], key: tuple, seen: set,
               repeats: int,
               summary: Callable[[list[float]], float] = statistics.median,
               streamed: bool = False) -> Call:
  """Times `fn(max_new_tokens=N)` and its prefill, `fn(max_new_tokens=1)`,
  each `repeats` times, reduced by `summary` (the median; `min` where
  every repeat does the same work, so that only interference from
  elsewhere on the machine tells the timings apart).

  Both shapes run once untimed first (`warm_up`) unless `key` is in `seen`.
  The prefill call (prompt pass(es) and the first token, the loop exits at
  once) lets the decoding phase be reported apart from the prompt: the
  Leviathan et al. prediction models only the decoding phase.

  `streamed`: instead, each call streams its tokens (`on_tokens`, one host
  callback per step) and its prefill is the time until the host got the
  first token, so the decoding phase is timed within one call. Where the
  prompt pass dominates (many rows of long prompts), the difference of two
  calls' noisy times leaves the short decoding phase little precision.
  """
  if streamed:
    warmup = 0.0 if key in seen else warm_up(fn, key, seen,
                                             streamed=True)[1]
    runs = [_streamed(fn) for _ in range(repeats)]
    return Call(runs[0][2], summary([r[0] for r in runs]), warmup,
                summary([r[1] for r in runs]))
  prefill = functools.partial(fn, max_new_tokens=1)
  warmup = 0.0 if key in seen else warm_up(fn, key, seen)[1]
  seconds, out = _time(fn, repeats, summary)
  prefill_s, _ = _time(prefill, repeats, summary)
  return Call(out, seconds, warmup, prefill_s)
