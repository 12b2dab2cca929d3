"""`MatmulKernel`: the one seam between the model and a kernel library.

Shape letters (`specjax.shapes`): X rows (batch times chunk), I input
features, O output features, L layers.

A `MatmulPlan` whose `kernel` holds one sends the model's few-row products
to it instead of XLA's dot (`specjax.models.matmul.project`,
`specjax.models.quantized.matmul`), and runs the layers as one loop where
it can read every layer's matrices in place (`loops`). The model imports
no kernel: the loaders hand it a plan carrying one (the CPU wing's
`specjax.cpu.SMALLM`), so the same model code runs on any backend.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping, Sequence

import jax

__all__ = ["MatmulKernel"]


class MatmulKernel(abc.ABC):
  """A library of few-row matrix products, declared once.

  Implementations are static and compared by value (a frozen dataclass):
  a plan holding one is part of a jitted function's static key.

  Attributes:
    max_rows: the most rows X one `matmul` call takes.
  """

  max_rows: ClassVar[int]

  @abc.abstractmethod
  def available(self) -> bool:
    """Whether it runs here (backend, build)."""

  @abc.abstractmethod
  def supports(self, w: Any) -> bool:
    """Whether it multiplies the packed format of `w`, a
    `QuantizedMatrix` (`specjax.models.quantized`)."""

  @abc.abstractmethod
  def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [X, I] float32 times w [O, I] float32 -> [X, O] float32, X at
    most `max_rows`."""

  @abc.abstractmethod
  def quantized_matmul(self, x: jax.Array, w: Any) -> jax.Array:
    """x [X, I] float32 times a `QuantizedMatrix` [O, I] it `supports`
    -> [X, O] float32, any X."""

  @abc.abstractmethod
  def pick(self, x: jax.Array, index: jax.Array,
           ws: tuple[Any, ...] | jax.Array, in_out: bool = False
           ) -> jax.Array:
    """A loop's product: x [X, I] float32 times ws[index] -> [X, O]
    float32, any X, reading the chosen matrix where it lies.

    Args:
      x: [X, I] float32.
      index: int32 scalar, the layer or expert (traced: the loop's
        counter).
      ws: L matrices [O, I] float32, or L `QuantizedMatrix`es it
        `supports` (formats may differ between layers, act_bits may not),
        or one float32 array [L, O, I] (a layer's stacked experts), or one
        stacked `QuantizedMatrix` [L, O, I] (every array with a leading
        [L]) of a format it `supports`.
      in_out: float32 matrices are stored [I, O] ([L, I, O]) instead.
    """

  @abc.abstractmethod
  def loops(self, layers: Sequence[Mapping[str, Any]], dtype: Any) -> bool:
    """Whether `pick` multiplies every matrix of `layers` (one dict of
    parameters per layer, each name a matrix in all of them or in none)
    by activations of `dtype`, so that they can run as one loop."""
