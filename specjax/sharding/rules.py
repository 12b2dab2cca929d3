"""Partition rules: one table mapping parameter paths to mesh axes.

Shape letters (`specjax.shapes`): V vocab, E hidden, H query heads, K
key/value heads, D head dim, F MLP size, X experts, F_s shared expert size.

Each rule names, for a parameter path (`specjax.models.config.flatten`:
`embed`, `layers_3/q`, ...), a logical axis per dimension of its canonical
[in, out] shape, as big_vision and jax-llm-examples do: attention heads and
MLP columns (q, k, v, gate, up) split on their output, their partners (o,
down) on their input, so each layer needs one all-reduce after o and one
after down (Megatron's layout). A mixture of experts splits each expert
the same way (all three [X, F, E] on F), so that
gathering a token's experts needs no communication and the layer still
ends in one all-reduce; the router [E, X] stays whole. Each device then
holds 1/n of every expert. Splitting X instead (expert parallelism) would
make `moe.experts_loop`'s index of a chosen expert all-gather the whole
stack (docs/accelerators.md, "Mixtures of experts on 8 v5e chips").
Logical axes then map to mesh axes:

- `heads`, `mlp` -> `MODEL`;
- `vocab` or `embed` -> `MODEL`, as `head` chooses. "vocab" (the default)
  splits the embedding and LM head by token: each device computes the
  logits of its slice of V and nothing [B, T, V]-sized is summed across
  devices, which is what a (γ+1)-token verification pass needs. "hidden"
  splits them on E instead: the LM head then ends in an all-reduce of
  partial [B, T, V] logits, cheaper only when V is small.
  `scripts/bench_sharding.py` measures both.

A mesh axis that does not divide its dimension is dropped for it (the
dimension stays whole on every device), so any model runs on any mesh;
`replicated_large` lists what that left whole.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from specjax.models import config as config_lib
from specjax.models.config import matrix_paths
from specjax.models import stacking
from specjax.models.matmul import MatmulPlan
from specjax.shapes import MODEL
from specjax.shapes import mesh_axis

# (path regex, logical axes of the canonical [in, out] shape); first match.
RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed", ("vocab", "embed")),  # [V, E]
    (r"lm_head", ("embed", "vocab")),  # [E, V]
    (r"layers_\d+/(q|k|v)", (None, "heads")),  # [E, H*D] / [E, K*D]
    (r"layers_\d+/(q|k|v)_bias", ("heads",)),  # [H*D] / [K*D]
    (r"layers_\d+/o", ("heads", None)),  # [H*D, E]
    (r"layers_\d+/(gate|up)", (None, "mlp")),  # [E, F]
    (r"layers_\d+/down", ("mlp", None)),  # [F, E]
    (r"layers_\d+/router", (None, None)),  # [E, X]
    (r"layers_\d+/experts_(gate|up|down)", (None, "mlp", None)),  # [X, F, E]
    (r"layers_\d+/shared_(gate|up)", (None, "mlp")),  # [E, F_s]
    (r"layers_\d+/shared_down", ("mlp", None)),  # [F_s, E]
    (r"layers_\d+/shared_expert_gate", (None, None)),  # [E, 1]
    (r"(layers_\d+/)?\w*norm", (None,)),  # [E]
)
HEADS = ("vocab", "hidden")


def logical_axes(path: str) -> tuple[str | None, ...]:
  """The logical axes of parameter `path` (canonical layout).

  Raises:
    ValueError: no rule matches `path`.
  """
  for pattern, axes in RULES:
    if re.fullmatch(pattern, path):
      return axes
  raise ValueError(f"No partition rule matches parameter {path!r}; add one "
                   "to specjax.sharding.rules.RULES.")


def mesh_axes(head: str = "vocab", split: bool = True
              ) -> dict[str, str | None]:
  """Logical axis -> mesh axis. `split=False` replicates everything (a
  small draft model copied to every device)."""
  if head not in HEADS:
    raise ValueError(f"head must be one of {HEADS}, got {head!r}.")
  if not split:
    return {}
  return {"heads": MODEL, "mlp": MODEL,
          "vocab": MODEL if head == "vocab" else None,
          "embed": MODEL if head == "hidden" else None}


def param_spec(path: str, shape: tuple[int, ...], mesh: Mesh, *,
               transposed: bool = False, head: str = "vocab",
               split: bool = True) -> PartitionSpec:
  """The `PartitionSpec` of one stored parameter.

  Args:
    path: its `flatten` path.
    shape: its stored shape.
    mesh: the device mesh.
    transposed: it is stored [out, in] (a projection under a transposed
      `MatmulPlan`).
    head: "vocab" or "hidden", see the module docstring.
    split: False replicates.
  """
  axes = logical_axes(path)
  if transposed:
    axes = axes[::-1]
  if len(axes) != len(shape):
    raise ValueError(f"Rule for {path!r} has {len(axes)} axes, the parameter "
                     f"has shape {shape}.")
  to_mesh = mesh_axes(head, split)
  spec = []
  for axis, size in zip(axes, shape):
    spec.append(mesh_axis(to_mesh.get(axis), size, mesh))
  return PartitionSpec(*spec)


def param_specs(config: config_lib.ModelConfig, mesh: Mesh, *,
                plan: MatmulPlan = MatmulPlan(), **kwargs) -> dict[str, Any]:
  """`param_spec` for every parameter of `config` stored as `plan` says,
  as the params pytree. Keywords as `param_spec` (head, split)."""
  transposed = set(matrix_paths(config)) if plan.transposed else set()
  def spec(path, shape):
    if path in transposed:
      shape = shape[::-1]
    return param_spec(path, shape, mesh, transposed=path in transposed,
                      **kwargs)
  specs = config_lib.unflatten(config, spec)
  if plan.scan_layers:  # [L, ...]: the layer axis stays whole
    specs = stacking.stack_layers(
        specs, config.num_layers,
        combine=lambda per_layer: PartitionSpec(None, *per_layer[0]))
  return specs


def replicated_large(params: Any, min_bytes: int = 1 << 20) -> list[str]:
  """Paths of parameters of at least `min_bytes` that every device holds
  whole although the mesh has a model axis of size > 1."""
  out = []
  for path, x in config_lib.flatten(params).items():
    sharding = x.sharding
    if (isinstance(sharding, NamedSharding) and x.nbytes >= min_bytes
        and sharding.mesh.shape[MODEL] > 1
        and sharding.is_fully_replicated):
      out.append(path)
  return out


def per_device_bytes(x: jax.Array) -> int:
  """Bytes of the largest shard of `x` one device holds."""
  shard = x.sharding.shard_shape(x.shape)
  return int(np.prod(shard)) * x.dtype.itemsize

