"""How the model's matrix products are computed: `MatmulPlan` and `project`.

Shape letters (`specjax.shapes`): `...` leading axes (B batch, T chunk), I
input features, O output features, X = prod(...) rows.

A decode step multiplies X = B rows, and a verification pass X = B(γ+1)
rows, by every weight matrix. Both are bound by reading the weights, so
they should cost about the same. Whether they do depends on the CPU, the
stored layout and the dot implementation (BENCHMARKS.md). A plan fixes the
choice for a whole model:

- `layout="in_out"`: matrices stored [I, O], product `x @ W` (XLA dot);
- `layout="out_in"`: stored [O, I] (the checkpoint's own layout), contracted
  on the last axis;
- `kernel` (with "out_in"): a `MatmulKernel` library that products of at
  most `kernel_max_rows` rows go to, reading each weight row once for all
  rows; larger ones (prefill) go to XLA. A kernel plan also runs the
  layers as one loop (`layer_loop`), whose products all go to the kernel
  (`LayerPick`).

`project` is the model's one seam to a kernel: the model imports none, and
the loaders hand it a plan carrying one (`specjax.cpu.plan`, which also
measures which plan this machine runs fastest). Checkpoints and
`param_shapes(config)` always use [I, O]; `Model.with_plan` transposes once
at load. Every plan computes the same products: the logits agree to
float32 rounding (tests check each plan against transformers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models import quantized
from specjax.models.kernel import MatmulKernel

__all__ = ["LAYOUTS", "LayerPick", "MatmulPlan", "project"]

LAYOUTS = ("in_out", "out_in")


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
  """A static, hashable choice of weight layout and dot implementation.

  Attributes:
    layout: "in_out" (stored [I, O]) or "out_in" (stored [O, I]).
    kernel: the `MatmulKernel` small products go to (needs out_in), or
      None for XLA's dots (a false value, as `dataclasses.replace(plan,
      kernel=False)`, also means None).
    kernel_max_rows: the most rows X sent to the kernel.
    kernel_min_rows: the fewest rows X of a float matrix sent to the
      kernel; 2 leaves the one-row product of a decode step to XLA
      ("out_in/hybrid": on some CPUs XLA's matrix-vector product is the
      faster one). Packed matrices go to the kernel at any X.
    layer_loop: with `kernel`, run the layers of a float32 or
      kernel-quantized model as one loop (`Transformer`), every product
      of it in the kernel, which reads the layer's matrix in place; False
      unrolls them (each layer compiled).
    scan_layers: store the layers stacked [L, ...] and run them as one
      `lax.scan` of XLA's dots (`specjax.models.stacking`): the GPU and
      TPU layout. Not with `kernel`, which has its own loop.
    row_invariant: with `kernel`, attention over a cache takes one query
      row at a time, with the chunk placed in its cache slots
      (`block.attend_by_row`), so that a row's sums run as a one-token
      step's do; with the kernel's row-invariant products, a verification
      pass then reproduces decode steps bit for bit. Int8 activations need
      it (`Model.with_activations` sets it). Without a kernel it does
      nothing: XLA's products are not row-invariant, so attention by row
      would buy no exactness.
  """

  layout: str = "in_out"
  kernel: MatmulKernel | None = None
  kernel_max_rows: int = 32
  kernel_min_rows: int = 1
  layer_loop: bool = True
  scan_layers: bool = False
  row_invariant: bool = False

  def __post_init__(self):
    if not self.kernel:
      object.__setattr__(self, "kernel", None)
    if self.layout not in LAYOUTS:
      raise ValueError(f"Unknown matmul layout {self.layout!r}; expected one "
                       f"of {LAYOUTS}.")
    if self.kernel and self.layout != "out_in":
      raise ValueError("A kernel reads weights stored [out, in]: use "
                       "layout='out_in' with a kernel.")
    if self.kernel and self.scan_layers:
      raise ValueError("scan_layers runs XLA's dots; a kernel plan loops "
                       "over its layers itself (layer_loop).")
    if self.kernel is not None and not isinstance(self.kernel,
                                                  MatmulKernel):
      raise TypeError(f"MatmulPlan.kernel must be a MatmulKernel (e.g. "
                      f"specjax.cpu.SMALLM) or None, got {self.kernel!r}.")
    if self.kernel_max_rows < 1 or (
        self.kernel and self.kernel_max_rows > self.kernel.max_rows):
      raise ValueError(f"kernel_max_rows must be at least 1 and at most "
                       f"the kernel's max_rows, got {self.kernel_max_rows}.")
    if not 1 <= self.kernel_min_rows <= self.kernel_max_rows:
      raise ValueError(f"kernel_min_rows must be in [1, kernel_max_rows], "
                       f"got {self.kernel_min_rows}.")

  def loops(self, layers: Sequence[Mapping[str, Any]], dtype: Any) -> bool:
    """Whether these layers' parameters (one dict each) may run as one
    loop of kernel products (`layer_loop`, `MatmulKernel.loops`)."""
    return bool(self.kernel and self.layer_loop
                and self.kernel.loops(layers, dtype))

  @property
  def name(self) -> str:
    """'in_out/xla', 'out_in/xla', 'out_in/kernel' or 'out_in/hybrid';
    '/scan' follows with `scan_layers` ('in_out/xla/scan')."""
    if not self.kernel:
      return f"{self.layout}/xla" + ("/scan" if self.scan_layers else "")
    impl = "kernel" if self.kernel_min_rows == 1 else "hybrid"
    return f"{self.layout}/{impl}"

  @classmethod
  def parse(cls, name: str,
            kernel: MatmulKernel | None = None) -> "MatmulPlan":
    """Inverts `name`, e.g. MatmulPlan.parse('out_in/xla').

    Args:
      name: a plan's `name`.
      kernel: the library of a kernel plan ('out_in/kernel',
        'out_in/hybrid'); `specjax.cpu.plan(name)` passes the CPU wing's.

    Raises:
      ValueError: an unknown name, or a kernel plan's without `kernel`.
    """
    layout, _, impl = name.partition("/")
    impl, _, scan = impl.partition("/")
    if impl not in ("xla", "kernel", "hybrid") or scan not in ("", "scan"):
      raise ValueError(f"Unknown matmul plan {name!r}; expected "
                       "'in_out/xla', 'out_in/xla', 'out_in/kernel', "
                       "'out_in/hybrid', or an xla plan + '/scan'.")
    if impl != "xla" and kernel is None:
      raise ValueError(f"Matmul plan {name!r} routes products to a kernel "
                       "library, and none was given: use "
                       f"specjax.cpu.plan({name!r}).")
    return cls(layout=layout, kernel=kernel if impl != "xla" else None,
               kernel_min_rows=2 if impl == "hybrid" else 1,
               scan_layers=bool(scan))

  @classmethod
  def for_backend(cls, backend: str | None = None) -> "MatmulPlan":
    """The plan a model gets on a backend without tuning: layers stacked
    and scanned on GPU and TPU; the checkpoint's layout on CPU, where
    `specjax.cpu.plans` measures the candidates instead."""
    backend = backend or jax.default_backend()
    return cls(scan_layers=backend != "cpu")

  @property
  def transposed(self) -> bool:
    """Whether matrices are stored [O, I], i.e. transposed from checkpoints."""
    return self.layout == "out_in"

  def stored_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
    """The stored shape of a matrix that checkpoints hold as [I, O]."""
    return tuple(reversed(shape)) if self.transposed else tuple(shape)


@flax.struct.dataclass
class LayerPick:
  """One layer's weight matrix inside a layer loop (`Transformer`): every
  layer's matrix, and the loop's counter saying which to use. `project`
  multiplies by `ws[index]` in the plan's kernel (`MatmulKernel.pick`),
  which reads it in place.

  Attributes:
    ws: L matrices [O, I] float32, or L `QuantizedMatrix`es (formats may
      differ between layers), one per layer of the loop.
    index: int32 scalar, the layer.
  """

  ws: tuple[jax.Array, ...]
  index: jax.Array


def project(x: jax.Array,
            w: jax.Array | quantized.QuantizedMatrix | LayerPick,
            plan: MatmulPlan,
            out_dtype: jnp.dtype | None = None) -> jax.Array:
  """x [..., I] times a weight stored per `plan` -> [..., O].

  Args:
    x: [..., I] activations.
    w: [I, O] ("in_out") or [O, I] ("out_in"); or a `QuantizedMatrix`,
      always [O, I] whatever the plan, dequantised inside the computation
      (`specjax.models.quantized.matmul`; with `plan.kernel`, products of
      up to `kernel_max_rows` rows, or of any number with int8
      activations, read its packed rows in the kernel); or a `LayerPick`,
      multiplied in the kernel whatever the number of rows.
    plan: the model's plan (static).
    out_dtype: the result's dtype (accumulation is float32); default x's.

  Returns:
    [..., O].
  """
  lead = x.shape[:-1]
  rows = 1
  for n in lead:
    rows *= n
  kernel = plan.kernel
  if isinstance(w, LayerPick):
    out = kernel.pick(x.reshape(rows, x.shape[-1]), w.index, w.ws)  # [X, O]
    return out.reshape(*lead, out.shape[-1]).astype(out_dtype or x.dtype)
  if quantized.is_quantized(w):
    # With int8 activations the kernel's integer products beat XLA's
    # dequantise-then-dot at prefill sizes too (BENCHMARKS.md "Quantized
    # weights"). XLA dequantises the whole matrix for one row as for many,
    # so a hybrid plan's one-row products of packed matrices go to the
    # kernel as well.
    near = rows <= plan.kernel_max_rows or w.act_bits == 8
    return quantized.matmul(x, w, out_dtype,
                            kernel=kernel if near else None)
  if (kernel and plan.kernel_min_rows <= rows <= plan.kernel_max_rows
      and x.dtype == jnp.float32 and w.dtype == jnp.float32):
    out = kernel.matmul(x.reshape(rows, x.shape[-1]), w)  # [X, O]
    return out.reshape(*lead, w.shape[0]).astype(out_dtype or x.dtype)
  contract = 1 if plan.transposed else 0
  return jax.lax.dot_general(
      x, w, (((x.ndim - 1,), (contract,)), ((), ())),
      preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)
