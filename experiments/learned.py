"""Verification passes that earlier runs of a job took, for pricing the job
before it runs.

`quantize="auto"` chooses float or block weights by the matrix products of
the call a run will make (`specjax.cpu.quantize.Workload`), and most of a
speculative call is its verification passes: how many depends on the
drafter, the target and the prompts. It does not depend on how the weights
are stored (the float and block models are the same model, bit for bit),
nor on the machine, so what one run of a job measured prices the next run
of that job anywhere. Before a job's first run, the passes are E[steps] at
the acceptance prior.

`record(config, steps_per_call)` keeps the newest run's headline passes per
call in `<cache>/tuning/passes.json` under `job_key(config)`: every config
field that can change what a call generates (target, draft, drafter, γ, B,
N, prompts, sampling, controls, ...), i.e. all but the ones listed in
`_IGNORED`. `steps_per_call(config)` reads it back, or None.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any

from specjax import store

__all__ = ["job_key", "record", "steps_per_call"]

# Config fields that change how a run is timed, stored or reported, never
# what its calls generate.
_IGNORED = ("cache_dir", "cost_repeats", "jax_cache_dir", "matmul",
            "output_dir", "pass_at_1", "pass_at_1_timeout", "plots",
            "progress", "quantize", "save_text", "timing_repeats")


def job_key(config: Any) -> str:
  """The job's key: target|drafter|γ=G|B=B|N=N|<hash of the other fields>."""
  fields = {k: v for k, v in config.to_dict().items() if k not in _IGNORED}
  digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str
                                     ).encode()).hexdigest()[:16]
  return (f"{config.target}|{config.drafter}|γ={config.gamma}"
          f"|B={config.batch_size}|N={config.max_new_tokens}|{digest}")


def _check_entry(entry: Any) -> None:
  if not float(entry["steps_per_call"]) >= 1:
    raise ValueError("steps_per_call must be >= 1")


def _path(config: Any) -> os.PathLike:
  return store.path_for("passes", config.get("cache_dir") or None)


def record(config: Any, steps: float) -> None:
  """Keeps `steps` verification passes per call as the job's newest."""
  path = _path(config)
  entries = store.read(path, _check_entry)
  entries[job_key(config)] = {
      "steps_per_call": float(steps),
      "measured": datetime.datetime.now().isoformat(timespec="seconds")}
  store.write(path, entries)


def steps_per_call(config: Any) -> float | None:
  """Passes per call the job's newest recorded run took, or None."""
  entry = store.read(_path(config), _check_entry).get(job_key(config))
  return None if entry is None else float(entry["steps_per_call"])
