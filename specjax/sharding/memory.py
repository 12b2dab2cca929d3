"""Memory planned before compiling: weights, KV caches and the widest pass's
activations, bytes per device.

Shape letters (`specjax.shapes`): B batch rows (padded to the data axis), P
padded prompt, S cache size, T rows of one pass, L layers, H heads, K
key/value heads, D head dim, E hidden, F MLP width, V vocab.

A long compile that ends in an XLA out-of-memory error wastes minutes; the
bytes that dominate decoding are known from shapes alone. `plan` counts,
for each model, its parameters and its cache [2, L, B, S, K, D] as the
mesh splits them (`rules.param_specs`, `KVCache.partition_spec`), the
float32 logits [B, T, V] of its widest step, and, once, the temporaries of
the widest pass any model runs (`activations`); `MemoryPlan.check` raises
before anything compiles when they exceed the device's memory.

A pass of T rows reading the cache holds, at its peak, either three float32
attention-score arrays [B, H, T, S + T] (the scores over the cache, all
scores, the probabilities) or four [B, T, F] MLP arrays (gate, up, their
product, the activation's operand), beside two [B, T, E] (the residual
stream and its norm); a pass that reads no cache has scores [B, H, T, T].
The widest passes are the prefill's (chunks of T = 64 prompt rows reading
the cache, or one pass over the whole buffer, T = P, reading none;
`Decoder.prefill`) and the step's (T = γ + 1 rows reading the cache).
Passes run one after another, so only the largest counts. Against XLA's own
`memory_analysis()` of the whole compiled call the plan is within 20%
(`tests/test_memory_plan.py`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from specjax import cache as cache_lib
from specjax.models import Model
from specjax.models.config import flatten
from specjax.models.config import matrix_paths
from specjax.models.config import param_shapes
from specjax.models.decoder import chunked
from specjax.models.decoder import PREFILL_CHUNK
from specjax.models.protocol import array_bytes
from specjax.padding import prompt_bucket
from specjax.sharding import place
from specjax.sharding import rules
from specjax.shapes import DATA
from specjax.shapes import MODEL

# Arrays live at a pass's peak (module docstring): float32 attention scores
# [B, H, T, S + T], MLP arrays [B, T, F], residual-stream arrays [B, T, E].
SCORE_ARRAYS = 3
MLP_ARRAYS = 4
STREAM_ARRAYS = 2


@dataclasses.dataclass(frozen=True)
class Entry:
  """One buffer of the plan.

  Attributes:
    model: which model ("target", "draft").
    kind: "weights", "cache", "logits" or "activations".
    total: bytes of the whole array(s).
    per_device: bytes the most loaded device holds.
    shape: what the bytes are, for messages (e.g. "prefill: 4 x [B, T, F]
      = 4 x [64, 64, 128] float32").
  """

  model: str
  kind: str
  total: int
  per_device: int
  shape: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device of every model's weights, cache and logits, and of
  the widest pass's activations.

  Attributes:
    entries: one per (model, kind); "activations" once, for the model
      whose widest pass is the largest.
    devices: devices in the mesh (1 without one).
    limit: bytes one device has (`device_memory`), or None if unknown.
    batch: B the plan is for (padded to the data axis).
    cache_size: S.
  """

  entries: tuple[Entry, ...]
  devices: int
  limit: int | None
  batch: int
  cache_size: int

  @property
  def per_device(self) -> int:
    return sum(e.per_device for e in self.entries)

  def bytes(self, model: str, kind: str) -> int:
    """Per-device bytes of one entry."""
    return sum(e.per_device for e in self.entries
               if (e.model, e.kind) == (model, kind))

  def table(self) -> str:
    """The plan as a fixed-width table."""
    rows = [(e.model, e.kind, _size(e.total), _size(e.per_device))
            for e in self.entries]
    rows.append(("sum", "", _size(sum(e.total for e in self.entries)),
                 _size(self.per_device)))
    lines = [f"{'model':8} {'buffer':11} {'total':>11} {'per device':>11}"]
    lines += [f"{a:8} {b:11} {c:>11} {d:>11}" for a, b, c, d in rows]
    limit = "unknown" if self.limit is None else _size(self.limit)
    lines.append(f"device memory {limit}; B={self.batch}, "
                 f"S={self.cache_size}, {self.devices} device(s)")
    return "\n".join(lines)

  @property
  def largest(self) -> Entry:
    """The entry with the most bytes per device."""
    return max(self.entries, key=lambda e: e.per_device)

  def check(self) -> "MemoryPlan":
    """Raises `MemoryError` naming the bytes, the largest buffer and every
    part when a device cannot hold the plan; returns the plan otherwise."""
    if self.limit is not None and self.per_device > self.limit:
      big = self.largest
      shape = f" ({big.shape})" if big.shape else ""
      parts = ", ".join(f"{e.model} {e.kind} {_size(e.per_device)}"
                        for e in self.entries)
      raise MemoryError(
          f"This call needs {self.per_device} bytes "
          f"({_size(self.per_device)}) per device but a device has "
          f"{self.limit} bytes ({_size(self.limit)}). The largest buffer is "
          f"the {big.model} {big.kind}, {_size(big.per_device)}{shape}. All: "
          f"{parts}; batch {self.batch}, cache size {self.cache_size}, "
          f"{self.devices} device(s). Lower the batch or the cache size, "
          "or split over more devices (specjax.sharding.make_mesh).")
    return self


def plan(models: dict[str, Any], *, batch: int, cache_size: int,
         chunk: int = 1, prompt_width: int | None = None,
         mesh: Mesh | None = None,
         limit: int | None | str = "device") -> MemoryPlan:
  """The memory one decoding call needs, from shapes only.

  Args:
    models: name -> `Model`, in order: a placed model counts its own
      shards; one not placed counts what decoding with `mesh=` makes of
      it (the first split, the others replicated; `batch.Placement`).
      Other `LanguageModel`s are skipped.
    batch: B (padded to the data axis here).
    cache_size: S.
    chunk: T of the widest step (γ + 1, or the tree's nodes + 1), for the
      logits and the step's activations.
    prompt_width: P, the padded prompt buffer the prefill runs (default
      `padding.prompt_bucket` of a short prompt in S).
    mesh: the mesh (default: the models' own, `place.mesh_of`).
    limit: bytes per device; "device" reads it (`device_memory`); None
      skips the check.

  Returns:
    The `MemoryPlan`.
  """
  found = [m for m in models.values() if isinstance(m, Model)]
  mesh = mesh if mesh is not None else place.mesh_of(*found)
  batch = place.padded_batch(batch, mesh)
  width = prompt_width or prompt_bucket(1, cache_size)  # P
  passes = {"prefill": prefill_pass(width, cache_size),
            "step": (chunk, cache_size + chunk)}
  entries, activations, held = [], [], []
  for i, (name, model) in enumerate(models.items()):
    if not isinstance(model, Model):
      continue
    if any(model.params is params for params in held):
      # The same arrays (a fewer-experts self-draft): held once.
      entries.append(Entry(name, "weights", 0, 0, "the target's own"))
    else:
      entries.append(_weights(name, model, mesh, split=i == 0))
      held.append(model.params)
    entries.append(_cache(name, model, batch, cache_size, mesh))
    logits = batch * chunk * model.config.vocab_size * 4
    data = 1 if mesh is None else mesh.shape[DATA]
    entries.append(Entry(name, "logits", logits, logits // data))
    activations += [_activations(name, model, batch, rows, keys, mesh,
                                 split=i == 0, label=label)
                    for label, (rows, keys) in passes.items()]
  if activations:
    entries.append(max(activations, key=lambda e: e.per_device))
  if limit == "device":
    limit = device_memory()
  return MemoryPlan(entries=tuple(entries),
                    devices=1 if mesh is None else mesh.size, limit=limit,
                    batch=batch, cache_size=cache_size)


def prefill_pass(width: int, cache_size: int) -> tuple[int, int]:
  """(T, keys): rows and keys read of the prefill's widest pass over a
  prompt buffer of P = `width` in a cache of S = `cache_size`, as
  `Decoder.prefill` runs it: chunks of `PREFILL_CHUNK` rows reading the
  cache and themselves (S + T keys), or one pass over the buffer alone
  (T keys)."""
  if not chunked(width, cache_size):
    return width, width
  return PREFILL_CHUNK, cache_size + PREFILL_CHUNK


def device_memory(device: jax.Device | None = None) -> int | None:
  """Bytes one device can hold: the accelerator's limit, or on CPU the
  host's physical memory shared by its local CPU devices."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  if device.platform == "cpu":
    try:
      total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
      return None
    return total // len(jax.local_devices(backend="cpu"))
  return None


def _weights(name: str, model: Model, mesh: Mesh | None,
             split: bool) -> Entry:
  """A placed model's own shards, or else the shards `shard(model, mesh,
  split=split)` would make."""
  leaves = jax.tree.leaves(model.params)
  stored = sum(map(array_bytes, leaves))
  if model.mesh is not None:  # placed: its own shards, packed or not
    return Entry(name, "weights", stored,
                 sum(rules.per_device_bytes(x) for x in leaves))
  if getattr(model, "quantization", None):
    # Packed codes, scales and mins as stored; not placed, so whole.
    return Entry(name, "weights", stored, stored)
  item = jnp.dtype(model.dtype).itemsize
  shapes = flatten(param_shapes(model.config))
  total = sum(int(np.prod(s)) for s in shapes.values()) * item
  if mesh is None:
    return Entry(name, "weights", total, total)
  specs = flatten(rules.param_specs(model.config, mesh, plan=model.plan,
                                    split=split))
  transposed = set(matrix_paths(model.config)) if model.plan.transposed else ()
  per = sum(_shard_bytes(shape[::-1] if path in transposed else shape,
                         specs[path], mesh, item)
            for path, shape in shapes.items())
  return Entry(name, "weights", total, per)


def _cache(name: str, model: Model, batch: int, size: int,
           mesh: Mesh | None) -> Entry:
  c = model.config
  shape = jax.eval_shape(lambda: cache_lib.KVCache.zeros(
      num_layers=c.num_layers, batch=batch, size=size,
      num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype))
  leaves = jax.tree.leaves(shape)
  total = sum(map(array_bytes, leaves))
  if mesh is None:
    return Entry(name, "cache", total, total)
  specs = jax.tree.leaves(shape.partition_spec(mesh),
                          is_leaf=lambda x: isinstance(x, PartitionSpec))
  per = sum(_shard_bytes(x.shape, s, mesh, x.dtype.itemsize)
            for x, s in zip(leaves, specs))
  return Entry(name, "cache", total, per)


def _activations(name: str, model: Model, batch: int, rows: int, keys: int,
                 mesh: Mesh | None, split: bool, label: str) -> Entry:
  """The peak temporaries of one pass of T = `rows` reading `keys` keys
  (module docstring): the larger of its attention and MLP phases, with
  the residual stream. A split model's heads and MLP columns divide over
  the model axis, and B over the data axis."""
  c = model.config
  item = jnp.dtype(model.dtype).itemsize
  width = c.intermediate_size * max(c.num_experts_per_tok, 1) + (
      c.shared_expert_size)  # F of the MLPs a token runs
  scores = SCORE_ARRAYS * batch * c.num_heads * rows * keys * 4
  mlp = MLP_ARRAYS * batch * rows * width * item
  stream = STREAM_ARRAYS * batch * rows * c.hidden_size * item
  if scores >= mlp:
    read = "S + T" if keys > rows else "T"
    shape = (f"{label}: {SCORE_ARRAYS} x [B, H, T, {read}] = "
             f"{SCORE_ARRAYS} x [{batch}, {c.num_heads}, {rows}, {keys}] "
             "float32")
  else:
    shape = (f"{label}: {MLP_ARRAYS} x [B, T, F] = {MLP_ARRAYS} x "
             f"[{batch}, {rows}, {width}] {jnp.dtype(model.dtype).name}")
  total = max(scores, mlp) + stream
  if mesh is None:
    return Entry(name, "activations", total, total, shape)
  data, split_by = mesh.shape[DATA], mesh.shape[MODEL] if split else 1
  per = -(-max(scores, mlp) // (data * split_by)) + -(-stream // data)
  return Entry(name, "activations", total, per, shape)


def _size(n: int) -> str:
  """Bytes in the largest binary unit that keeps the number >= 1."""
  for unit, scale in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if n >= 1 << scale:
      return f"{n / (1 << scale):.2f} {unit}"
  return f"{n} B"


def _shard_bytes(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh,
                 itemsize: int) -> int:
  dims = list(shape)
  for i, axis in enumerate(tuple(spec)[:len(dims)]):
    if axis is not None:
      dims[i] = -(-dims[i] // mesh.shape[axis])
  return int(np.prod(dims)) * itemsize
