"""`SMALLM`: the specjax CPU kernels as a `MatmulPlan`'s kernel library.

Shape letters (`specjax.shapes`): X rows (batch times chunk), I input
features, O output features, L layers.

A plan with `kernel=SMALLM` (`plan("out_in/kernel")`) sends the model's
few-row products here instead of XLA's dot, through the model's one seam
(`specjax.models.MatmulKernel`): float32 matrices stored [O, I] to
`kernels.smallm_matmul`, packed ones to `kernels.smallm_quantized`, and a
layer loop's products to the `_pick` kernels, which read the chosen
layer's matrix where it lies.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Sequence

import jax
import jax.numpy as jnp

from specjax.cpu import kernels
from specjax.models import MatmulKernel
from specjax.models import MatmulPlan
from specjax.models import quantized

__all__ = ["SMALLM", "SmallM", "plan"]


def _arrays(w: quantized.QuantizedMatrix) -> dict[str, Any]:
  """w as `kernels.smallm_quantized` takes it: every argument but x and
  int8_activations (each array with a leading [L] where w is a stack)."""
  return dict(codes=w.low, scales=w.scales, mins=w.mins, high=w.high,
              super_scales=w.super_scales, super_mins=w.super_mins,
              bits=w.bits, group=w.group, offset=w.offset)


@dataclasses.dataclass(frozen=True)
class SmallM(MatmulKernel):
  """The `smallm.cc` kernels (`specjax.cpu.kernels`): each weight row read
  once for all X rows, from float32 or packed codes (q8_0, q5_0, q4_k,
  q6_k, int8 and int4 with their usual groups: `supports`)."""

  max_rows: ClassVar[int] = kernels.MAX_ROWS

  def available(self) -> bool:
    return kernels.available()

  def supports(self, w: quantized.QuantizedMatrix) -> bool:
    """`kernels.quantized_format_ok` for w's bits, group, inputs and
    activations."""
    return kernels.quantized_format_ok(w.bits, w.group, w.cols,
                                       bool(w.act_bits))

  def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
    return kernels.smallm_matmul(x, w)

  def quantized_matmul(self, x: jax.Array,
                       w: quantized.QuantizedMatrix) -> jax.Array:
    """x [X, I] float32 times w -> [X, O] float32, in pieces of at most
    `max_rows` rows, each reading w once."""
    pieces = [kernels.smallm_quantized(x[i:i + self.max_rows], **_arrays(w),
                                       int8_activations=w.act_bits == 8)
              for i in range(0, x.shape[0], self.max_rows)]
    return jnp.concatenate(pieces)  # [X, O]

  def pick(self, x: jax.Array, index: jax.Array,
           ws: tuple[Any, ...] | jax.Array, in_out: bool = False
           ) -> jax.Array:
    if quantized.is_quantized(ws) and ws.low.ndim == 3:  # [L, O, I]
      return kernels.smallm_quantized_pick(
          x, index, _arrays(ws), int8_activations=ws.act_bits == 8)
    if isinstance(ws, tuple) and quantized.is_quantized(ws[0]):
      return kernels.smallm_quantized_pick(
          x, index, tuple(_arrays(w) for w in ws),
          int8_activations=ws[0].act_bits == 8)
    return kernels.smallm_pick(x, index, ws, in_out=in_out)

  def loops(self, layers: Sequence[Mapping[str, Any]], dtype: Any) -> bool:
    """float32 activations, the kernels available here, and every matrix
    float32 or packed in a format it `supports`, all with one act_bits;
    a name packed in every layer or in none."""
    if dtype != jnp.float32 or not self.available():
      return False
    leaves = [w for p in layers for w in p.values()]
    packed = [w for w in leaves if quantized.is_quantized(w)]
    return (all(quantized.is_quantized(w) or w.dtype == jnp.float32
                for w in leaves)
            and all(self.supports(w) for w in packed)
            and len({w.act_bits for w in packed}) <= 1
            and len({(name, quantized.is_quantized(w))
                     for p in layers for name, w in p.items()})
            == len(layers[0]))


SMALLM = SmallM()


def plan(name: str) -> MatmulPlan:
  """The plan `name` ('in_out/xla', 'out_in/xla', 'out_in/kernel',
  'out_in/hybrid', an xla plan + '/scan'), its kernel `SMALLM`."""
  return MatmulPlan.parse(name, kernel=SMALLM)
