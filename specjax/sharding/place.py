"""Meshes, and models and batches placed on them.

Shape letters (`specjax.shapes`): B batch rows, B_pad rows after padding to
a multiple of the data axis.

- `make_mesh(data=, model=)`: a 2-D mesh over any device set (all local
  and remote devices by default, so it is the global mesh under
  `jax.distributed`).
- `shard(model, mesh)`: parameters placed by `rules.param_specs`; the model
  remembers its mesh (`Model.mesh`), so its caches and the decoders follow.
- `placer(config, mesh)`: the same placement one tensor at a time, for
  loaders, so a host never holds a model twice.
- `global_array(host, sharding)`: an array over the mesh from a value every
  process holds whole (`jax.make_array_from_callback`; one process or many).
- `host(x)`: a (possibly multi-process) array back as one numpy array.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from specjax.models import Model
from specjax.models.config import ModelConfig
from specjax.models.config import flatten
from specjax.models.matmul import MatmulPlan
from specjax.sharding import rules
from specjax.shapes import DATA
from specjax.shapes import MODEL


def make_mesh(data: int = -1, model: int = 1,
              devices: list[jax.Device] | None = None) -> Mesh:
  """A `(DATA, MODEL)` mesh of `data * model` devices.

  Args:
    data: rows split `data` ways; -1 takes every device `model` leaves.
    model: heads, MLP and vocabulary split `model` ways.
    devices: the devices (default `jax.devices()`, every process's).

  Raises:
    ValueError: the sizes are not positive or do not use exactly the
      devices given (naming both).
  """
  devices = list(jax.devices() if devices is None else devices)
  if model < 1 or (data < 1 and data != -1):
    raise ValueError(f"Mesh sizes must be >= 1 (data may be -1), got "
                     f"data={data}, model={model}.")
  if data == -1:
    if len(devices) % model:
      raise ValueError(f"model={model} does not divide the {len(devices)} "
                       "devices.")
    data = len(devices) // model
  if data * model != len(devices):
    raise ValueError(f"A {data}x{model} (data x model) mesh needs "
                     f"{data * model} devices; {len(devices)} given.")
  return jax.make_mesh((data, model), (DATA, MODEL), devices=devices,
                       axis_types=(AxisType.Auto, AxisType.Auto))


def shard(model: Model, mesh: Mesh, *, head: str = "vocab",
          split: bool = True) -> Model:
  """`model` with its parameters placed on `mesh` (`rules.param_specs`).

  Args:
    model: a loaded `Model` (any placement).
    mesh: from `make_mesh`.
    head: "vocab" or "hidden": how the embedding and LM head split.
    split: False replicates every parameter (a draft small enough to copy
      to each device, which then drafts without communication).

  Returns:
    The model on `mesh`; `Model.mesh` is set, so its caches are laid out on
    it too. A plan routing products to the specjax CPU kernel (a custom
    call GSPMD cannot split) keeps its layout but uses XLA's dots.
  """
  if model.plan.kernel and mesh.size > 1:
    model = model.with_plan(dataclasses.replace(model.plan, kernel=None))
  specs = rules.param_specs(model.config, mesh, plan=model.plan, head=head,
                            split=split)
  params = jax.tree.map(
      lambda x, s: x if _placed(x, mesh, s) else global_array(
          x, NamedSharding(mesh, s)),
      model.params, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return model.replace(params=params, mesh=mesh)


def placer(config: ModelConfig, mesh: Mesh, *,
           plan: MatmulPlan = MatmulPlan(), head: str = "vocab",
           split: bool = True) -> Callable[[str, np.ndarray], jax.Array]:
  """`place(path, host_array)` putting one parameter on `mesh`, for
  loaders reading tensor by tensor (each device receives only its
  shard)."""
  specs = flatten(rules.param_specs(config, mesh, plan=plan, head=head,
                                    split=split))
  return lambda path, x: global_array(x, NamedSharding(mesh, specs[path]))


def global_array(x: Any, sharding: NamedSharding) -> jax.Array:
  """`x` (a host or device array every process holds whole) as a
  `jax.Array` laid out by `sharding`; each process supplies only the
  shards its own devices hold."""
  if isinstance(x, jax.Array) and x.is_fully_addressable and (
      x.sharding.is_fully_addressable and sharding.is_fully_addressable):
    return jax.device_put(x, sharding)
  host_x = np.asarray(x)
  return jax.make_array_from_callback(host_x.shape, sharding,
                                      lambda index: host_x[index])


def host(x: jax.Array) -> np.ndarray:
  """`x` as one numpy array on every process (gathered across processes
  when some of its shards live elsewhere)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mesh_of(*models: Any) -> Mesh | None:
  """The one mesh the given models (or drafters holding a `Model`) are
  placed on, or None when none is.

  Raises:
    ValueError: two of them are on different meshes, or some are placed
      and others are not (every array of one program must be on one mesh).
  """
  found = {id(m): getattr(m, "mesh", None) for m in _models(models)}
  meshes = {m for m in found.values() if m is not None}
  if not meshes:
    return None
  if len(meshes) > 1 or None in found.values():
    raise ValueError(
        "The models are placed on different meshes (or only some are "
        "placed): shard target and draft on one mesh with "
        "specjax.sharding.shard (split=False replicates the draft).")
  return meshes.pop()


def padded_batch(batch: int, mesh: Mesh | None) -> int:
  """B_pad: B rounded up to a multiple of the data axis."""
  if mesh is None:
    return batch
  data = mesh.shape[DATA]
  return -(-batch // data) * data


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Rows [B_pad, ...] split on the data axis."""
  return NamedSharding(mesh, PartitionSpec(DATA, *([None] * (ndim - 1))))


def _placed(x: Any, mesh: Mesh, spec: PartitionSpec) -> bool:
  sharding = getattr(x, "sharding", None)
  return isinstance(sharding, NamedSharding) and sharding.mesh == mesh and (
      sharding.spec == spec)


def _models(objects: tuple[Any, ...]) -> list[Any]:
  """The `Model`s among `objects` and inside them (a drafter's draft, an
  early-exit drafter's target), found through their pytree children."""
  leaves = jax.tree.leaves(objects, is_leaf=lambda x: isinstance(x, Model))
  return [leaf for leaf in leaves if isinstance(leaf, Model)]
