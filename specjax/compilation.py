"""Compiling once per shape, and saying so.

A real model takes tens of seconds to compile, so the decoders keep the
number of programs small (see `specjax.decode`) and make every compilation
visible:

- `call(jitted, name, shapes, ...)` runs a jitted function and, when the
  call compiled a new program, logs one line with the time XLA spent
  (tracing, lowering and backend compilation, read from JAX's monitoring
  events) and counts it in `num_compiled()`; `compiled()` lists them.
- `enable_persistent_cache()` turns on JAX's persistent compilation cache in
  `$SPECJAX_CACHE/xla_cache` (default ~/.cache/specjax/xla_cache), so a
  second process reuses what the first compiled. `call` does so once, at
  the first call of a decoder (never at import), unless the user set
  `jax_compilation_cache_dir` already or set `SPECJAX_NO_COMPILE_CACHE=1`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from typing import Any, Callable

import jax

from specjax import paths

__all__ = ["Compiled", "call", "compiled", "enable_persistent_cache",
           "num_compiled"]

OPT_OUT = "SPECJAX_NO_COMPILE_CACHE"
_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")
_seconds = [0.0]  # compile time seen so far in this process
_counts: collections.Counter = collections.Counter()
_history: list["Compiled"] = []
_log = logging.getLogger("specjax")


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One program `call` compiled: what, for which shapes, and the seconds
  JAX spent tracing, lowering and compiling it."""

  name: str
  shapes: str
  seconds: float


def _listener(event: str, duration: float, **kwargs: Any) -> None:
  del kwargs
  if event in _EVENTS:
    _seconds[0] += duration


@functools.cache
def _first_call() -> None:
  """What the first `call` of a process sets up: the compile-time
  listener and the persistent compilation cache."""
  jax.monitoring.register_event_duration_secs_listener(_listener)
  enable_persistent_cache()


def enable_persistent_cache(directory: str | os.PathLike | None = None
                            ) -> str | None:
  """Turns on JAX's persistent compilation cache, unless opted out.

  Args:
    directory: where; default `$SPECJAX_CACHE/xla_cache`.

  Returns:
    The cache directory in use (the user's own if they set one), or None.
  """
  current = jax.config.jax_compilation_cache_dir
  if current or os.environ.get(OPT_OUT):
    return current or None
  directory = os.fspath(directory or paths.cache_root() / "xla_cache")
  jax.config.update("jax_compilation_cache_dir", directory)
  return directory


def call(jitted: Callable[..., Any], name: str, shapes: str, *args: Any,
         **kwargs: Any) -> Any:
  """`jitted(*args, **kwargs)`, logging a line if it compiled a program.

  Args:
    jitted: a `jax.jit`-wrapped function.
    name: what it is, for the log (e.g. "speculative_generate").
    shapes: the static shapes that keyed the program, for the log.
  """
  _first_call()
  before, seconds = jitted._cache_size(), _seconds[0]  # pylint: disable=protected-access
  out = jitted(*args, **kwargs)
  if jitted._cache_size() > before:  # pylint: disable=protected-access
    _counts[name] += 1
    _history.append(Compiled(name, shapes, _seconds[0] - seconds))
    _log.info("specjax: compiled %s for %s in %.1f s", name, shapes,
              _seconds[0] - seconds)
  return out


def compiled() -> tuple[Compiled, ...]:
  """Every program `call` compiled in this process, oldest first."""
  return tuple(_history)


def num_compiled(name: str | None = None) -> int:
  """Programs `call` compiled in this process (for `name`, or all)."""
  return _counts[name] if name else sum(_counts.values())
