"""Where a compiled step spends its time, by operation class.

`profile_step(step, lowered, repeats)` runs a jitted step under
`jax.profiler.trace`, reads the Perfetto trace, and adds the duration of
every XLA thunk (named after its HLO instruction) into a class read from the
compiled HLO: the instruction's `op_name` metadata (the Flax module path
and the JAX primitive) or, for fusions without metadata, that of the
instructions it fuses. The classes are:

- `weight products`: the projections (`_dense`, the specjax kernel);
- `lm head`: the vocabulary projection (`logits`);
- `attention`: score and value products over the cache and the chunk,
  softmax and masking;
- `cache`: writes into and copies of the KV cache;
- `norms`, `rope`, `embedding`, and `other`.

Thunks of different threads overlap, so class totals are CPU time (summed
over threads) per call, and `wall_ms` is the step's own wall time.

`executed_ops(step)` counts the XLA operations a call executes, every
iteration of its loops included: the per-operation overhead that
dominates where operations are small (a GPU's kernel launches).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import Any, Callable

import jax

__all__ = ["CLASSES", "classify_hlo", "executed_ops", "ops_per_step",
           "profile_step"]

CLASSES = ("weight products", "lm head", "attention", "cache", "norms",
           "rope", "embedding", "other")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")


def _op_class(op_name: str, line: str) -> str:
  """One class for an instruction from its op_name and HLO line."""
  if "specjax_smallm" in line or "_dense" in op_name:
    return "weight products"
  if "logits" in op_name:
    return "lm head"
  leaf = op_name.rsplit("/", 1)[-1]
  if any(k in op_name for k in ("attention", "softmax")) or leaf in (
      "dot_general", "exp", "reduce_max", "div", "select_n", "concatenate"):
    return "attention"
  if leaf in ("dynamic_update_slice", "scatter") or "write" in op_name:
    return "cache"
  if leaf in ("rsqrt", "integer_pow", "reduce_sum", "square") or (
      "norm" in op_name):
    return "norms"
  if leaf in ("sin", "cos") or "rope" in op_name:
    return "rope"
  if leaf in ("gather", "take") or "_take" in op_name:
    return "embedding"
  return "other"


def classify_hlo(hlo_text: str) -> dict[str, str]:
  """Maps every HLO instruction name in `hlo_text` to a class in CLASSES."""
  computations: dict[str, list[tuple[str, str, str | None]]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and line.rstrip().endswith("{"):
      current = computations.setdefault(header.group(1), [])
      continue
    match = _INSTRUCTION.match(line)
    if match and current is not None:
      called = _CALLS.search(line)
      current.append((match.group(1), line, called and called.group(1)))

  def op_name_of(line: str, called: str | None, depth: int = 0) -> str:
    found = _OP_NAME.search(line)
    if found:
      return found.group(1)
    if called and depth < 4:
      for _, inner, inner_called in computations.get(called, []):
        name = op_name_of(inner, inner_called, depth + 1)
        if name:
          return name
    return ""

  def has_dot(line: str, called: str | None) -> bool:
    if " dot(" in line or "custom_call_target" in line:
      return True
    return bool(called) and any(" dot(" in inner for _, inner, _ in
                                computations.get(called, []))

  out = {}
  for body in computations.values():
    for name, line, called in body:
      if " copy(" in line and "cache" in line:
        out[name] = "cache"
      elif has_dot(line, called):
        # Dots lose their metadata in layout passes; their operands tell.
        if "params__embed" in line or "params__lm_head" in line:
          out[name] = "lm head"
        elif "model_params__" in line:
          out[name] = "weight products"
        else:
          out[name] = "attention"
      else:
        out[name] = _op_class(op_name_of(line, called), line)
  return out


def profile_step(step: Callable[[], Any], hlo_text: str,
                 repeats: int = 5) -> dict[str, Any]:
  """Profiles `repeats` calls of `step` (already compiled and warm).

  Args:
    step: runs the jitted computation whose compiled HLO is `hlo_text`.
    hlo_text: `jitted.lower(...).compile().as_text()` of that computation.
    repeats: calls traced.

  Returns:
    `{"wall_ms": ..., "classes_ms": {class: CPU ms per call}}`.
  """
  classes = classify_hlo(hlo_text)
  events, wall = _trace(step, repeats)
  totals = collections.Counter()
  for event in events:
    cls = classes.get(event.get("name"))
    if cls is not None:
      totals[cls] += event.get("dur", 0.0) / 1e3 / repeats  # us -> ms
  return {"wall_ms": 1e3 * wall,
          "classes_ms": {c: totals.get(c, 0.0) for c in CLASSES}}


def executed_ops(step: Callable[[], Any], repeats: int = 3) -> float:
  """XLA operations executed per call of `step` (compiled and warm).

  The trace events that name an HLO instruction (`hlo_op`): a thunk each
  on the CPU, a kernel launch or more on a GPU, every iteration of a loop
  counted. Where operations are small, a step pays per operation (about a
  microsecond on the CPU runtime, a launch on a GPU) whatever it computes,
  so the count shows a step's fixed overhead that wall time on a CPU at
  large shapes hides.
  """
  events, _ = _trace(step, repeats)
  return sum("hlo_op" in (e.get("args") or {}) for e in events) / repeats


def ops_per_step(run: Callable[[int], Any], tokens: int) -> float:
  """XLA operations one decoding step executes.

  Args:
    run: run(n) generates n tokens per row (e.g. a `decode.generate` call
      with `max_new_tokens=n`; its result has `tokens`), every row taking
      n - 1 decoding steps after the prefill's first token.
    tokens: N >= 2.

  Returns:
    The operations of run(N) minus those of run(1) (prefill and setup),
    over the N - 1 steps; both are compiled and run once untraced first.
  """
  if tokens < 2:
    raise ValueError(f"tokens must be >= 2, got {tokens}.")
  counts = []
  for n in (tokens, 1):
    jax.block_until_ready(run(n).tokens)
    counts.append(executed_ops(lambda n=n: run(n).tokens, repeats=1))
  return (counts[0] - counts[1]) / (tokens - 1)


def _trace(step: Callable[[], Any], repeats: int
           ) -> tuple[list[dict[str, Any]], float]:
  """The complete ("X") Perfetto trace events of `repeats` calls of
  `step`, and the wall seconds per call."""
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(repeats):
        jax.block_until_ready(step())
    wall = (time.perf_counter() - start) / repeats
    (trace,) = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"),
                         recursive=True)
    with gzip.open(trace) as f:
      events = json.load(f)
  if isinstance(events, dict):
    events = events.get("traceEvents", [])
  return [e for e in events if e.get("ph") == "X"], wall
