"""The decoders' side of a mesh: models placed, rows padded and split.

Shape letters (`specjax.shapes`): B batch rows, B_pad = B rounded up to a
multiple of the data axis, P padded prompt width.

`generate` and `speculative_generate` take `mesh=` (or read it from models
placed with `shard`) and go through `Placement`: the batch is padded to
B_pad with one-token rows whose budget is 0 new tokens, so they start done
and are never advanced (they ride along in the batched passes, which have
static shapes anyway); prompts, lengths and budgets are split over the data
axis; results come back to the host and are cut to the B real rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from specjax.models import Model
from specjax.sharding import memory
from specjax.sharding import place


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one decoding call runs.

  Attributes:
    mesh: the mesh, or None for one device (every method is then the
      identity, up to moving results to the host).
    batch: B, the caller's rows.
  """

  mesh: Mesh | None
  batch: int

  @classmethod
  def resolve(cls, mesh: Mesh | None, batch: int, *models: Any
              ) -> tuple["Placement", tuple[Any, ...]]:
    """The placement and the models to run.

    With `mesh` given, a `Model` not yet placed is placed on it: the first
    (the target) split by `shard`, the others (a draft) replicated.
    Without, the models' own mesh is used (`place.mesh_of`).

    Raises:
      ValueError: the models are on another mesh than `mesh`, or on
        different meshes.
    """
    if mesh is not None:
      models = tuple(
          place.shard(m, mesh, split=i == 0)
          if isinstance(m, Model) and m.mesh is None else m
          for i, m in enumerate(models))
    found = place.mesh_of(*models)
    if mesh is not None and found is not None and found != mesh:
      raise ValueError("mesh= differs from the mesh the models are placed "
                       "on; pass one of them.")
    return cls(mesh=found, batch=batch), models

  @property
  def padded(self) -> int:
    """B_pad."""
    return place.padded_batch(self.batch, self.mesh)

  def inputs(self, tokens: np.ndarray, lengths: np.ndarray,
             max_new_tokens: int) -> tuple[Any, Any, Any]:
    """Prompts, lengths and the new-token budget, padded and split.

    Args:
      tokens: [B, P] int32 padded prompts.
      lengths: [B] int32.
      max_new_tokens: N.

    Returns:
      tokens [B_pad, P], lengths [B_pad], and N: a [] int32 when no row was
      added, else [B_pad] int32 with 0 for the added rows (numpy arrays
      without a mesh, else global `jax.Array`s).
    """
    extra = self.padded - self.batch
    # Numpy in: a jitted call transfers it (`jnp.asarray` would compile
    # a program per shape).
    budget = np.int32(max_new_tokens)
    if extra:
      tokens = np.concatenate([tokens, np.zeros((extra,) + tokens.shape[1:],
                                                tokens.dtype)])
      lengths = np.concatenate([lengths, np.ones((extra,), lengths.dtype)])
      budget = np.array([max_new_tokens] * self.batch + [0] * extra,
                        np.int32)
    if self.mesh is None:
      return tokens, lengths, budget
    split = lambda x: place.global_array(
        x, place.batch_sharding(self.mesh, np.ndim(x)))
    return (split(tokens), split(lengths),
            split(budget) if extra else budget)

  def check_memory(self, models: dict[str, Any], *, cache_size: int,
                   chunk: int, prompt_width: int | None = None) -> None:
    """`memory.plan(...).check()` for this call's shapes (`prompt_width`:
    P, the padded prompts' width): fails, naming the sizes and the largest
    buffer, before compiling a program that cannot fit."""
    memory.plan(models, batch=self.padded, cache_size=cache_size,
                chunk=chunk, prompt_width=prompt_width,
                mesh=self.mesh).check()

  def rows(self, tree: Any) -> Any:
    """Results -> numpy, those with a row axis [B_pad, ...] cut to
    [B, ...] (scalars, e.g. a policy's step counter, kept whole)."""
    def cut(x):
      x = place.host(x)
      return x[:self.batch] if x.ndim and x.shape[0] == self.padded else x
    return jax.tree.map(cut, tree)

  def totals(self, tree: Any) -> Any:
    """Results without a row axis -> numpy."""
    return jax.tree.map(place.host, tree)
