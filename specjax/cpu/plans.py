"""Choosing a model's `MatmulPlan` by measuring, once per machine.

Shape letters (`specjax.shapes`): E hidden, F MLP, H query heads, K
key/value heads, D head dim, V vocab, X rows per product (batch times
chunk).

Which formulation of the model's matrix products keeps a verification pass
(X = B(γ+1) rows) as cheap as a decode step (X = B) depends on the CPU, not
only on its kind (BENCHMARKS.md). `tune` therefore times every candidate
plan (`candidates`) on a stack of weight matrices of the model's own shapes
(q, k, v, o, gate, up, down per layer, enough layers to exceed the caches,
plus a slice of the vocabulary head), at each X in `rows`: one plan's
products round-robin, then the next plan's, in passes until two agree
(`hardware.settled_ms`). It picks the plan with the least total time over
`rows`, i.e. one decode step plus one verification pass for the default
rows (1, 5).
Kernel plans carry `specjax.cpu.SMALLM`.

The choice and the timings are cached in `<cache>/tuning/matmul.json`
under a key naming the CPU model, core count, backend, JAX version, the kernel
sources' hash, the candidate plans, dtype, shapes and rows. Deleting the file
re-measures; a corrupt file is ignored with a warning and rewritten. A user
forces a plan with `matmul=NAME` (or `SPECJAX_MATMUL=NAME` in the
environment), NAME one of `PLANS`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from specjax import hardware
from specjax import store
from specjax.cpu import kernels
from specjax.cpu.matmul import SMALLM
from specjax.models import MatmulPlan
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models.matmul import project

__all__ = ["PLANS", "TuneResult", "apply", "cache_file", "cache_key",
           "candidates",
           "head_plan", "run_layers", "stack", "tune"]

PLANS = ("in_out/xla", "out_in/xla", "out_in/kernel", "out_in/hybrid")
_STACK_BYTES = 512 << 20  # more than any CPU's last-level cache
_HEAD_ROWS = 32768  # vocabulary rows of the head slice
_REPEATS = 7


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """What `tune` chose and why.

  Attributes:
    plan: the chosen plan.
    source: "measured", "cache" or "forced".
    timings_ms: plan name -> {str(X): median ms of the stack at X rows};
      empty when forced.
    rows: the X values timed.
    key: the cache key.
  """

  plan: MatmulPlan
  source: str
  timings_ms: dict[str, dict[str, float]]
  rows: tuple[int, ...]
  key: str

  def to_json(self) -> dict[str, Any]:
    ratios = {name: {m: t[m] / t[str(self.rows[0])] for m in t}
              for name, t in self.timings_ms.items()}
    return {"plan": self.plan.name, "source": self.source,
            "rows": list(self.rows), "timings_ms": self.timings_ms,
            "ratio_to_first_rows": ratios, "key": self.key}


def cache_file(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  return store.path_for("matmul", cache_dir)


def candidates(dtype: Any) -> list[str]:
  """Plan names worth timing here: the kernel only for float32 on CPU."""
  names = ["in_out/xla", "out_in/xla"]
  if jnp.dtype(dtype) == jnp.float32 and SMALLM.available():
    names += ["out_in/kernel", "out_in/hybrid"]
  return names


def _shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
  """(in, out) of each matrix of one layer, and of the head slice."""
  e, f = config.hidden_size, config.intermediate_size
  q = config.num_heads * config.head_dim
  kv = config.num_kv_heads * config.head_dim
  return {"q": (e, q), "k": (e, kv), "v": (e, kv), "o": (q, e),
          "gate": (e, f), "up": (e, f), "down": (f, e),
          "head": (e, min(config.vocab_size, _HEAD_ROWS))}


def cache_key(config: ModelConfig, dtype: Any,
              rows: Sequence[int] | None) -> str:
  """Names the machine, kernel sources, candidates, dtype, shapes, rows
  (None: an entry that holds timings per row count) and how the steps were
  timed (`hardware.TIMED`)."""
  shapes = ",".join(f"{k}={i}x{o}" for k, (i, o) in _shapes(config).items())
  # The candidates are in the key: a new candidate plan re-measures.
  return (f"{hardware.machine_key()}|kernel={kernels.source_hash()}|"
          f"plans={'+'.join(candidates(dtype))}|"
          f"{jnp.dtype(dtype).name}|{shapes}"
          + ("" if rows is None else f"|rows={','.join(map(str, rows))}")
          + f"|timed={hardware.TIMED}")


def stack(config: ModelConfig, dtype: Any, plan: MatmulPlan,
          head_rows: int = _HEAD_ROWS):
  """Weights of enough layers to exceed the caches, stored per `plan`,
  filled with 0.01, and the first `head_rows` rows of the head [V', E]."""
  shapes = _shapes(config)
  shapes["head"] = (config.hidden_size, min(config.vocab_size, head_rows))
  layer_bytes = sum(i * o for n, (i, o) in shapes.items() if n != "head")
  layer_bytes *= jnp.dtype(dtype).itemsize
  num_layers = max(1, min(config.num_layers, -(-_STACK_BYTES // layer_bytes)))
  fill = jax.jit(lambda: [
      {n: jnp.full(plan.stored_shape(s), 0.01, dtype)
       for n, s in shapes.items() if n != "head"}
      for _ in range(num_layers)])
  head = jnp.full(head_plan(plan).stored_shape(shapes["head"]),
                  0.01, dtype)  # [V', E], like the tied embedding
  return fill(), head


def run_layers(x: jax.Array, layers: Sequence[dict[str, Any]],
               plan: MatmulPlan) -> jax.Array:
  """Applies every matrix of `layers` (dicts of q, k, v, o, gate, up,
  down, stored per `plan`, or `QuantizedMatrix`es) once to x [X, E],
  chaining so nothing is skipped -> [X, E]."""
  for w in layers:
    qkv = project(x, w["q"], plan)
    qkv = qkv + jnp.sum(project(x, w["k"], plan) + project(x, w["v"], plan))
    x = x + project(qkv, w["o"], plan)
    h = project(x, w["gate"], plan) * project(x, w["up"], plan)
    x = x + project(h, w["down"], plan)
  return x


def head_plan(plan: MatmulPlan) -> MatmulPlan:
  """The plan of the head [V, E], stored [O, I] like the tied embedding."""
  return dataclasses.replace(plan, layout="out_in")


def _forward(plan: MatmulPlan):
  """Applies every matrix once to x [X, E], then the head."""

  @jax.jit
  def forward(x, layers, head):
    return project(run_layers(x, layers, plan), head, head_plan(plan))

  return forward


def _measure(config: ModelConfig, dtype: Any, names: Sequence[str],
             rows: Sequence[int]) -> dict[str, dict[str, float]]:
  steps = {}
  for name in names:
    plan = MatmulPlan.parse(name, SMALLM)
    layers, head = stack(config, dtype, plan)
    forward = _forward(plan)
    for m in rows:
      x = jnp.full((m, config.hidden_size), 0.5, dtype)
      steps[(name, m)] = (lambda f=forward, x=x, l=layers, h=head: f(x, l, h))
  times = hardware.settled_ms(steps, _REPEATS, group=lambda k: k[0])
  out: dict[str, dict[str, float]] = {}
  for (name, m), ms in times.items():
    out.setdefault(name, {})[str(m)] = ms
  return out


def _check_entry(entry: Any) -> None:
  MatmulPlan.parse(entry["plan"], SMALLM)
  if not isinstance(entry["timings_ms"], dict):
    raise ValueError("an entry has no timings")


def tune(config: ModelConfig, dtype: Any = jnp.float32, *,
         rows: Sequence[int] = (1, 5), matmul: str | MatmulPlan = "auto",
         cache_dir: str | os.PathLike | None = None) -> TuneResult:
  """The plan for `config` on this machine: forced, cached, or measured.

  Args:
    config: the model's shapes.
    dtype: its parameter dtype.
    rows: the X values that matter (decode step and verification pass rows).
    matmul: "auto", or a plan (name) to force.
    cache_dir: cache root (default `$SPECJAX_CACHE` or ~/.cache/specjax).

  Returns:
    A `TuneResult`.
  """
  rows = tuple(int(m) for m in rows)
  key = cache_key(config, dtype, rows)
  matmul = os.environ.get("SPECJAX_MATMUL") or matmul
  if matmul != "auto":
    plan = matmul if isinstance(matmul, MatmulPlan) else MatmulPlan.parse(
        matmul, SMALLM)
    if plan.kernel and not plan.kernel.available():
      raise kernels.KernelError(
          f"Matmul plan {plan.name!r} was forced, but the specjax CPU kernels "
          "are not available here (CPU backend and a C++ compiler needed).")
    return TuneResult(plan=plan, source="forced", timings_ms={}, rows=rows,
                      key=key)
  if jax.default_backend() != "cpu":
    # One candidate off the CPU: XLA's dots on stacked, scanned layers.
    return TuneResult(plan=MatmulPlan.for_backend(), source="backend",
                      timings_ms={}, rows=rows, key=key)
  path = cache_file(cache_dir)
  entries = store.read(path, _check_entry)
  entry = entries.get(key)
  names = candidates(dtype)
  if entry is not None and entry["plan"] in names:
    return TuneResult(plan=MatmulPlan.parse(entry["plan"], SMALLM),
                      source="cache",
                      timings_ms=entry["timings_ms"], rows=rows, key=key)
  timings = _measure(config, dtype, names, rows)
  best = min(names, key=lambda n: sum(timings[n].values()))
  entries[key] = {"plan": best, "timings_ms": timings,
                  "measured": datetime.datetime.now().isoformat(
                      timespec="seconds")}
  store.write(path, entries)
  return TuneResult(plan=MatmulPlan.parse(best, SMALLM), source="measured",
                    timings_ms=timings, rows=rows, key=key)


def apply(model: Model, matmul: str | MatmulPlan = "auto", *,
          rows: Sequence[int] = (1, 5), donate: bool = False,
          cache_dir: str | os.PathLike | None = None
          ) -> tuple[Model, TuneResult]:
  """`model` with its tuned (or forced) plan, and the tuning result."""
  result = tune(model.config, model.dtype, rows=rows, matmul=matmul,
                cache_dir=cache_dir)
  return model.with_plan(result.plan, donate=donate), result
