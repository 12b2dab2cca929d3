"""What the tuning step measured, read back for a call: nothing is timed.

Shape letters (`specjax.shapes`): B batch, S cache size, T tokens per
forward.

The tuning step (`specjax.tuning`, `python -m specjax.tune`) writes two
files under the cache root (`specjax.store`), and `StepCosts.for_call`
reads them through this module:

- `cost.json`: per machine, model, plan, B, S and chunk lengths, a forward
  table (`table_key`): the ms of each T, as passes taken at different
  moments (`forward_ms` averages them);
- `machine.json`: per machine, its memory bandwidth and matmul rate
  (`machine_rates`).

Both are plain numbers, so the formula (`specjax.policies.costs`) builds
its own types from them, on any backend.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from specjax import hardware
from specjax import store
from specjax.models.protocol import declared
from specjax.models.protocol import LanguageModel

__all__ = ["check_entry", "check_machine", "forward_ms",
           "machine_rates", "table_key"]


def table_key(model: LanguageModel, batch: int, cache_size: int,
              chunks: Sequence[int]) -> str:
  """The key of `model`'s cost table at B, S and chunk lengths T: this
  machine's, then the model's own (`CostGeometry.key`), and how it was
  timed (`hardware.LOOPED`)."""
  geometry = declared(model).cost_geometry()
  return (f"{hardware.machine_key()}|{geometry.key}|B={batch}|"
          f"S={cache_size}|T={','.join(map(str, chunks))}|"
          f"timed={hardware.LOOPED}")


def check_entry(entry: Any) -> None:
  """Raises ValueError/KeyError/TypeError on an invalid table entry."""
  for times in [entry["forward_ms"], *entry.get("passes", [])]:
    if not all(float(v) > 0 for v in times.values()):
      raise ValueError("non-positive time")


def check_machine(entry: Any) -> None:
  """Raises ValueError/KeyError/TypeError on an invalid machine entry."""
  if not (float(entry["bandwidth"]) > 0 and float(entry["flops"]) > 0):
    raise ValueError("non-positive bandwidth or FLOP rate")


def forward_ms(model: LanguageModel, *, batch: int, chunks: Sequence[int],
               cache_size: int,
               cache_dir: str | os.PathLike | None = None
               ) -> dict[int, float] | None:
  """T -> mean ms of `model`'s measured forward at B, S and T = `chunks`,
  or None where the tuning step has not measured it."""
  chunks = tuple(sorted(set(int(t) for t in chunks)))
  entries = store.read(store.path_for("cost", cache_dir), check_entry)
  entry = entries.get(table_key(model, batch, cache_size, chunks))
  if entry is None:
    return None
  passes = [{int(t): float(v) for t, v in p.items()}
            for p in entry.get("passes", [entry["forward_ms"]])]
  return {t: float(np.mean([p[t] for p in passes])) for t in passes[0]}


def machine_rates(cache_dir: str | os.PathLike | None = None
                  ) -> dict[str, float] | None:
  """This machine's measured bandwidth (B/s), FLOP rate and per-forward
  overhead (ms; the nominal one where none was recorded), the keywords of
  `Roofline`, or None where the tuning step has not measured them."""
  entries = store.read(store.path_for("machine", cache_dir), check_machine)
  entry = entries.get(hardware.machine_key())
  if entry is None:
    return None
  overhead = entry.get("overhead_ms", hardware.nominal_rates()["overhead_ms"])
  return {"bandwidth": float(entry["bandwidth"]),
          "flops": float(entry["flops"]), "overhead_ms": float(overhead)}
