"""Quantized weight matrices: packed integer codes, per-group scales, mins.

Shape letters (`specjax.shapes`): O output features (rows), I input features
(the contraction axis, along which groups run), G group size, N = I / G
groups per row, X rows of activations.

A `QuantizedMatrix` holds a matrix stored [O, I] (the checkpoint's own
layout, whatever `MatmulPlan.layout` says for float matrices) as integer
codes c in [0, 2^bits) and one scale s (and, for some formats, one min m)
per group of G consecutive inputs of a row:

  w[o, i] = s[o, i // G] * (c[o, i] - offset) - m[o, i // G]

evaluated in float32 in exactly that order, so a GGUF block whose reference
dequantisation (`gguf.quants.dequantize`) computes the same expression
comes out bit for bit. Codes are packed in bit planes: the low four bits two
per byte (`low`; within each group, byte j holds element j in bits 0-3 and
element j + G/2 in bits 4-7, so unpacking writes two contiguous halves),
and for 5- and 6-bit formats the remaining 1 or 2 bits in `high`
(8 or 4 elements per byte, element k of a byte at bit k * hb). 8-bit codes
are stored as int8 in `low` (offset 0). Formats (`FORMATS`):

- "q8_0", "q5_0", "q4_k", "q6_k": GGUF blocks as `gguf_blocks` repacks
  them (scales of Q8_0 and Q5_0 stay float16; the K-quants keep their two
  levels: integer sub-block scales and mins, and per super-block of 256
  inputs a float16 d and dmin; s = d * scale and m = dmin * min in
  float32, exact products, as the reference computes them);
- "int8": per output channel (G = I), symmetric;
- "int4": grouped, symmetric (offset 8, no mins) or asymmetric (mins).

Matrices of one format stack into one `QuantizedMatrix` whose packed
arrays carry the leading axes (`stack`: a mixture of experts' [X, O, I]
experts, or the scan layout's [L, ...] layers); `select` takes one
matrix out of a stack, and `dequantize` works on either.

`matmul` dequantises inside the jitted computation: the packed arrays are
the program's parameters, and the float32 matrix exists only as an XLA
temporary of one call (XLA CPU writes it in one loop fusion and the dot
reads it back), so the weights cross memory as packed bytes plus that
temporary: exact, but not the bandwidth saving of a kernel that reads each
block once for all rows, which a plan's `MatmulKernel` is
(`matmul(..., kernel=...)`). `tests/test_quantized.py` checks in the
compiled HLO that the packed arrays are the parameters and no float32
[O, I] parameter or constant exists.

With `act_bits` 8 (`with_activations`, a ":a8" suffix on `quantize`) a
product first quantizes x to int8 per row and chunk of `ACT_CHUNK` inputs
(`quantize_activations`): a different model from the weight-only one,
which a kernel computes with integer dot products, as llama.cpp's
quantized matmuls do. Int8 codes turn a last-bit difference in x into a
different code now and then, so a verification pass reproduces the
decode steps only if each of its rows rounds as the same row alone. The
kernel's rows do (a row's codes, integer sums and float epilogue do not
depend on X), and so does attention by row (`MatmulPlan.row_invariant`,
which `with_activations` sets): on a kernel plan speculation on int8
activations is exact. XLA's products and its attention over all rows at
once group their sums by X, so elsewhere it is exact only up to rounding
(`Model.int8_rounding`): greedy output may part from `generate` at a
near-tie.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import expert_paths
from specjax.models.config import experts_out_in
from specjax.models.config import flatten
from specjax.models.config import matrix_paths
from specjax.models.config import unflatten
from specjax.models.kernel import MatmulKernel

__all__ = ["ACT_CHUNK", "FORMATS", "QuantSpec", "QuantizedMatrix",
           "dequantize", "dequantize_params", "is_quantized", "matmul",
           "quantize_activations", "quantize_array", "quantize_params",
           "quantize_stack", "select", "split_activations", "stack", "take",
           "with_activations"]

FORMATS = ("q8_0", "q5_0", "q4_k", "q6_k", "int8", "int4")
# Inputs per scale of int8 activations (`quantize_activations`; the CPU
# kernels' chunk too, `specjax.cpu.kernels.ACT_CHUNK`).
ACT_CHUNK = 64
# The `quantize` suffix that adds int8 activations ("gguf:a8").
_A8 = ":a8"


@flax.struct.dataclass(kw_only=True)
class QuantizedMatrix:
  """A weight matrix stored [O, I] as packed codes and per-group scales.

  Attributes:
    low: [O, I // 2] uint8 low nibbles (bits < 8, split per group as the
      module docstring says), or [O, I] int8 codes.
    high: [O, I * hb // 8] uint8 high bits (hb = bits - 4), or None.
    scales: [O, N] float16 or float32; or int8 / uint8 sub-scales, which
      `super_scales` multiplies.
    mins: [O, N] float32 subtracted after scaling, uint8 sub-mins which
      `super_mins` multiplies, or None.
    super_scales: [O, N // S] float16, the scale of each run of S groups
      (a K-quant super-block: S = 256 / G), or None: s[o, n] =
      super_scales[o, n // S] * scales[o, n] in float32.
    super_mins: [O, N // S] float16 for integer mins, or None.
    dense: [O, I] float32, the matrix dequantised once for products that
      do not read the packed rows (`with_dense`), or None: each such
      product dequantises it.
    fmt: one of `FORMATS` (static).
    bits: bits per code, 4, 5, 6 or 8 (static).
    group: G (static).
    offset: subtracted from the codes before scaling (static).
    shape: the logical parameter shape, as `param_shapes` gives it:
      [I, O] for projections, [V, E] = [O, I] for the embedding, [X, F, E]
      for a mixture of experts' stack (static).
    dtype: the dtype of the dequantised matrix (static).
    act_bits: 0 multiplies float activations; 8 quantizes them to int8
      per row and chunk of `ACT_CHUNK` inputs first (`quantize_activations`,
      llama.cpp's arithmetic: integer dot products), static.
  """

  low: jax.Array
  high: jax.Array | None = None
  scales: jax.Array
  mins: jax.Array | None = None
  super_scales: jax.Array | None = None
  super_mins: jax.Array | None = None
  dense: jax.Array | None = None
  fmt: str = flax.struct.field(pytree_node=False)
  bits: int = flax.struct.field(pytree_node=False)
  group: int = flax.struct.field(pytree_node=False)
  offset: int = flax.struct.field(pytree_node=False, default=0)
  shape: tuple[int, int] = flax.struct.field(pytree_node=False)
  dtype: Any = flax.struct.field(pytree_node=False, default=jnp.float32)
  act_bits: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def rows(self) -> int:
    """O."""
    return self.scales.shape[-2]

  @property
  def cols(self) -> int:
    """I."""
    return self.scales.shape[-1] * self.group

  @property
  def ndim(self) -> int:
    return 2

  @property
  def nbytes(self) -> int:
    """Bytes of the packed arrays (what a product reads)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(self.replace(dense=None)))

  def astype(self, dtype: Any) -> "QuantizedMatrix":
    """The same codes dequantising to `dtype` (scales are kept)."""
    return self.replace(dtype=jnp.dtype(dtype))


def is_quantized(w: Any) -> bool:
  return isinstance(w, QuantizedMatrix)


def _unpack_low(low: jax.Array, bits: int, group: int) -> jax.Array:
  """[R, I // 2] uint8 nibbles (or [R, I] int8) -> [R, I] int32."""
  if bits == 8:
    return low.astype(jnp.int32)
  low = low.astype(jnp.int32)
  lead, half = low.shape[:-1], group // 2
  low = low.reshape(*lead, -1, half)  # [R, N, G/2]
  both = jnp.concatenate([low & 15, low >> 4], axis=-1)  # [R, N, G]
  return both.reshape(*lead, -1)


def _unpack_high(high: jax.Array, hb: int) -> jax.Array:
  """[R, I * hb // 8] uint8 -> [R, I] int32 high bits (values < 2^hb)."""
  per = 8 // hb
  shifts = jnp.arange(per, dtype=jnp.int32) * hb
  parts = (high.astype(jnp.int32)[..., None] >> shifts) & ((1 << hb) - 1)
  return parts.reshape(*high.shape[:-1], high.shape[-1] * per)


def _two_level(sub: jax.Array | None, sup: jax.Array | None
              ) -> jax.Array | None:
  """[R, N] scales (or mins) as float32: sub itself, or with super-block
  factors sup [R, N // S], sup[r, n // S] * sub[r, n] (exact in float32)."""
  if sub is None or sup is None:
    return sub
  per = sub.shape[-1] // sup.shape[-1]
  return (jnp.repeat(sup.astype(jnp.float32), per, axis=-1)
          * sub.astype(jnp.float32))


def _dequantize_rows(w: QuantizedMatrix, low, high, scales, mins,
                     super_scales=None, super_mins=None) -> jax.Array:
  """The dequantised rows [R, I] float32 of (row-selected) packed arrays."""
  scales = _two_level(scales, super_scales)
  mins = _two_level(mins, super_mins)
  codes = _unpack_low(low, w.bits, w.group)
  if high is not None:
    codes = codes | (_unpack_high(high, w.bits - 4) << 4)
  if w.offset:
    codes = codes - w.offset
  lead = codes.shape[:-1]
  n = scales.shape[-1]
  vals = codes.astype(jnp.float32).reshape(*lead, n, w.group)
  out = vals * scales.astype(jnp.float32)[..., None]
  if mins is not None:
    out = out - mins[..., None]
  return out.reshape(*lead, n * w.group)


def dequantize(w: QuantizedMatrix) -> jax.Array:
  """[O, I] float32 (not `w.dtype`: the exact reference values)."""
  return _dequantize_rows(w, w.low, w.high, w.scales, w.mins,
                          w.super_scales, w.super_mins)


def with_dense(w: QuantizedMatrix) -> QuantizedMatrix:
  """`w` carrying its dequantised matrix (`dense`), computed here once:
  for the products of a program's branches, out of which XLA does not
  hoist the dequantisation it hoists out of a loop body."""
  return w.replace(dense=dequantize(w))


def quantize_activations(x: jax.Array) -> jax.Array:
  """x [..., I] float32 -> the float32 values of its int8 quantization.

  Each row's chunks of `ACT_CHUNK` inputs get d = max|x| / 127 and codes
  round(x / d) (half to even), as the CPU kernels compute them
  (`specjax/cpu/kernels/smallm.cc`): their integer products equal this
  times the dequantised matrix, summed in another order.
  """
  if x.shape[-1] % ACT_CHUNK:
    raise ValueError(f"int8 activations need inputs in chunks of "
                     f"{ACT_CHUNK}; got {x.shape[-1]}.")
  chunks = x.reshape(*x.shape[:-1], -1, ACT_CHUNK)  # [..., I / C, C]
  d = jnp.max(jnp.abs(chunks), axis=-1, keepdims=True) / 127.0
  codes = jnp.clip(jnp.round(chunks / jnp.where(d > 0, d, 1.0)), -127, 127)
  return (codes * d).reshape(x.shape)


def matmul(x: jax.Array, w: QuantizedMatrix, out_dtype: Any = None,
           kernel: MatmulKernel | None = None) -> jax.Array:
  """x [..., I] times the [O, I] matrix, contracted on I -> [..., O].

  Accumulation is float32; the matrix is dequantised in float32 and cast to
  x's dtype (a no-op for float32 models). With a `kernel` that runs here
  and `supports` w's format, and float32 x, the kernel reads the packed
  rows once for all X rows instead (`MatmulKernel.quantized_matmul`): the
  same weights, summed in another order. With `w.act_bits` 8, x is first
  quantized to int8 (`quantize_activations`; a kernel multiplies the
  integer codes).
  """
  if x.shape[-1] != w.cols:
    raise ValueError(f"Cannot multiply activations [..., {x.shape[-1]}] by "
                     f"a quantized {w.fmt} matrix [{w.rows}, {w.cols}].")
  if (kernel is not None and x.dtype == jnp.float32 and kernel.supports(w)
      and kernel.available()):
    lead = x.shape[:-1]
    out = kernel.quantized_matmul(x.reshape(-1, w.cols), w)  # [X, O]
    return out.reshape(*lead, w.rows).astype(out_dtype or x.dtype)
  if w.act_bits:
    x = quantize_activations(x.astype(jnp.float32)).astype(x.dtype)
  wf = (dequantize(w) if w.dense is None else w.dense).astype(x.dtype)
  out = jax.lax.dot_general(x, wf, (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return out.astype(out_dtype or x.dtype)


def with_activations(params: Any, bits: int) -> Any:
  """params with every quantized matrix multiplying `bits`-bit activations
  (8: int8, `quantize_activations`; 0: float).

  Raises:
    ValueError: bits not 0 or 8, params without a quantized matrix, or a
      matrix whose inputs are not chunks of `ACT_CHUNK`.
  """
  if bits not in (0, 8):
    raise ValueError(f"Activation bits must be 0 (float) or 8 (int8), got "
                     f"{bits!r}.")
  leaves = [(path, w) for path, w in jax.tree_util.tree_leaves_with_path(
      params, is_leaf=is_quantized) if is_quantized(w)]
  if not leaves:
    raise ValueError("int8 activations multiply quantized matrices, and "
                     "this model has none: quantize its weights first "
                     "(quantize='gguf', 'int8' or 'int4').")
  for path, w in leaves:
    if bits and w.cols % ACT_CHUNK:
      raise ValueError(
          f"The quantized {w.fmt} matrix {jax.tree_util.keystr(path)} "
          f"[{w.rows}, {w.cols}] cannot take int8 activations: its "
          f"{w.cols} inputs are not chunks of {ACT_CHUNK}.")
  return jax.tree.map(lambda w: w.replace(act_bits=bits)
                      if is_quantized(w) else w, params, is_leaf=is_quantized)


def take(w: jax.Array | QuantizedMatrix, ids: jax.Array) -> jax.Array:
  """Rows `ids` [...] of a [V, E] table -> [..., E] (an embedding lookup).

  A quantized table gathers only the packed rows it needs, then
  dequantises them: the same values as `dequantize(w)[ids]`.
  """
  if not is_quantized(w):
    return jnp.take(w, ids, axis=0)
  pick = lambda a: None if a is None else jnp.take(a, ids, axis=0)
  rows = _dequantize_rows(w, pick(w.low), pick(w.high), pick(w.scales),
                          pick(w.mins), pick(w.super_scales),
                          pick(w.super_mins))
  return rows.astype(w.dtype)


def stack(ws: list[QuantizedMatrix], shape: tuple[int, ...]
          ) -> QuantizedMatrix:
  """Matrices of one format -> one whose packed arrays are stacked on a
  new leading axis ([X, O, ...]); `shape` is the stack's logical shape.

  Raises:
    ValueError: the matrices differ in format or size.
  """
  statics = {(w.fmt, w.bits, w.group, w.offset, w.low.shape,
              w.high is None, w.mins is None, w.super_scales is None)
             for w in ws}
  if len(statics) != 1:
    raise ValueError(f"Cannot stack quantized matrices of different "
                     f"formats or sizes: {sorted(map(str, statics))}.")
  return jax.tree.map(lambda *a: np.stack(a), *ws).replace(
      shape=tuple(shape))


def quantize_stack(ws: np.ndarray, spec: QuantSpec, name: str,
                   shape: tuple[int, ...], dtype: Any = jnp.float32
                   ) -> QuantizedMatrix:
  """`quantize_array` of each matrix [O, I] of ws [X, O, I], stacked
  (`stack`) with the logical `shape`."""
  return stack([quantize_array(w, spec, name, dtype=dtype) for w in ws],
               shape=shape)


def select(w: QuantizedMatrix, *index: jax.Array | int) -> QuantizedMatrix:
  """The matrix at `index` (one int or traced scalar per leading axis) of a
  stack: every packed array indexed, [..., O, ...] -> [O, ...]; its
  `shape` then [O, I]."""
  picked = jax.tree.map(lambda a: a[index], w)
  return picked.replace(shape=(picked.rows, picked.cols))


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """How to quantize a float checkpoint's matrices (weight-only).

  Attributes:
    bits: 8 (per output channel) or 4 (grouped).
    group: inputs per scale for int4 (ignored for int8).
    symmetric: int4 without mins (codes centred on 8); int8 is always
      symmetric.
  """

  bits: int = 8
  group: int = 32
  symmetric: bool = False

  @classmethod
  def parse(cls, name: str) -> "QuantSpec":
    """"int8", "int4" (G=32, asymmetric), "int4:g64", "int4:g128:sym"."""
    match = re.fullmatch(r"int(8|4)((?::g\d+)?)((?::sym)?)", name)
    if not match:
      raise ValueError(f"Unknown weight quantization {name!r}; expected "
                       "'int8', 'int4', 'int4:g<group>' or "
                       "'int4:g<group>:sym'.")
    bits = int(match.group(1))
    if bits == 8 and (match.group(2) or match.group(3)):
      raise ValueError(f"{name!r}: int8 is per output channel and "
                       "symmetric; groups and ':sym' apply to int4.")
    group = int(match.group(2)[2:]) if match.group(2) else 32
    if group < 2 or group % 2:
      raise ValueError(f"{name!r}: the int4 group size must be even and "
                       "at least 2.")
    return cls(bits=bits, group=group, symmetric=bool(match.group(3)))


def parse(quantize: str | QuantSpec | None) -> str | QuantSpec | None:
  """A loader's `quantize` argument: None, "gguf" (keep a GGUF file's own
  blocks), or a QuantSpec ("int8", "int4", "int4:g64:sym")."""
  if quantize is None or quantize == "gguf" or isinstance(quantize,
                                                           QuantSpec):
    return quantize
  if isinstance(quantize, str) and quantize.endswith(_A8):
    raise ValueError(f"quantize={quantize!r}: int8 activations ({_A8!r}) "
                     "are set by registry.load_pretrained, Model.quantize "
                     "or Model.with_activations; checkpoint loaders take "
                     "the weight format alone.")
  if not isinstance(quantize, str) or not quantize.startswith("int"):
    raise ValueError(f"Unknown quantize={quantize!r}; expected None, 'gguf',"
                     " 'int8', 'int4', 'int4:g<group>' or "
                     "'int4:g<group>:sym'.")
  return QuantSpec.parse(quantize)


def split_activations(quantize: str | QuantSpec | None
                      ) -> tuple[str | QuantSpec | None, int]:
  """A `quantize` name and its activation bits: "gguf:a8" -> ("gguf", 8)
  (int8 activations, `with_activations`), "int4" -> ("int4", 0)."""
  if isinstance(quantize, str) and quantize.endswith(_A8):
    return quantize[:-len(_A8)], 8
  return quantize, 0


def quantize_array(w: np.ndarray, spec: QuantSpec, name: str,
                   shape: tuple[int, int] | None = None,
                   dtype: Any = jnp.float32) -> QuantizedMatrix:
  """Quantizes a float matrix stored [O, I] (rows are output channels).

  Args:
    w: [O, I] host array (float16/32/64, or bfloat16).
    spec: bits, group size, symmetry.
    name: the tensor's name, for errors.
    shape: the logical parameter shape (default [O, I]).
    dtype: the dequantised dtype.

  Returns:
    A QuantizedMatrix of numpy arrays (`jax.device_put` it).

  Raises:
    ValueError: w is not a matrix, or the group size does not divide I.
  """
  w = np.asarray(w, np.float32)
  if w.ndim != 2:
    raise ValueError(f"Tensor {name!r}: only matrices are quantized, got "
                     f"shape {w.shape}.")
  rows, cols = w.shape
  shape = (rows, cols) if shape is None else tuple(shape)
  if spec.bits == 8:
    amax = np.abs(w).max(axis=1, keepdims=True)  # [O, 1]
    scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return QuantizedMatrix(low=codes, scales=scale, fmt="int8", bits=8,
                           group=cols, shape=shape, dtype=jnp.dtype(dtype))
  if cols % spec.group:
    raise ValueError(f"Tensor {name!r}: group size {spec.group} does not "
                     f"divide its input dimension {cols} (shape {shape}).")
  g = w.reshape(rows, cols // spec.group, spec.group)  # [O, N, G]
  if spec.symmetric:
    amax = np.abs(g).max(axis=-1)
    scale = np.where(amax > 0, amax / 7, 1).astype(np.float32)  # [O, N]
    codes = np.clip(np.rint(g / scale[..., None]), -8, 7) + 8
    mins, offset = None, 8
  else:
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scale = np.where(hi > lo, (hi - lo) / 15, 1).astype(np.float32)
    codes = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15)
    mins, offset = (-lo).astype(np.float32), 0
  codes = codes.astype(np.uint8).reshape(rows, cols)
  return QuantizedMatrix(low=pack_nibbles(codes, spec.group), scales=scale,
                         mins=mins,
                         fmt="int4", bits=4, group=spec.group, offset=offset,
                         shape=shape, dtype=jnp.dtype(dtype))


def pack_nibbles(codes: np.ndarray, group: int) -> np.ndarray:
  """[R, I] codes (low 4 bits used) -> [R, I // 2] uint8: in each group of
  G, byte j holds element j (bits 0-3) and element j + G/2 (bits 4-7)."""
  c = codes.astype(np.uint8) & 15
  c = c.reshape(*c.shape[:-1], -1, group)  # [R, N, G]
  half = group // 2
  packed = c[..., :half] | (c[..., half:] << 4)  # [R, N, G/2]
  return packed.reshape(*c.shape[:-2], -1)


def pack_high(codes: np.ndarray, hb: int) -> np.ndarray:
  """[R, I] codes -> [R, I * hb // 8] uint8 of their bits 4 .. 4 + hb."""
  per = 8 // hb
  h = (codes.astype(np.uint8) >> 4) & ((1 << hb) - 1)
  h = h.reshape(*h.shape[:-1], h.shape[-1] // per, per)
  shifts = (np.arange(per) * hb).astype(np.uint8)
  return np.bitwise_or.reduce(h << shifts, axis=-1).astype(np.uint8)


def quantize_params(config: Any, params: Any, spec: QuantSpec | str, *,
                    out_in: bool = False,
                    donate: bool = False) -> dict[str, Any]:
  """A params pytree with every matrix (projections, LM head, embedding,
  a mixture of experts' experts) weight-only quantized; norms and biases
  stay as they are. Each expert of a stack [X, F, E] is quantized as the
  matrix [O, I] it is (gate and up [F, E], down [E, F]) and the stack kept
  as one (`stack`).

  Args:
    config: the `ModelConfig` the params belong to.
    params: laid out as `param_shapes(config)` (matrices [I, O], or [O, I]
      with `out_in`); matrices already quantized are kept.
    spec: a QuantSpec or its name ("int8", "int4", "int4:g64:sym").
    out_in: the projections are stored [O, I] (an "out_in" `MatmulPlan`).
    donate: delete each float matrix once it is quantized (the input params
      are unusable afterwards), so the peak stays near one model.

  Returns:
    The new params pytree (packed arrays on the default device).

  Raises:
    ValueError: a group size that does not divide a matrix's input
      dimension, naming the tensor.
  """
  if isinstance(spec, str):
    spec = QuantSpec.parse(spec)
  flat = flatten(params)
  transposed = set() if out_in else set(matrix_paths(config))
  for path in [*matrix_paths(config), "embed"]:
    w = flat[path]
    if is_quantized(w):
      continue
    host = np.asarray(w)
    # [I, O] -> [O, I]: rows are output channels; the embedding [V, E] is
    # already the tied head's [O, I].
    rows_first = host.T if path in transposed else host
    shape = tuple(w.shape) if path in transposed or path == "embed" else (
        tuple(reversed(w.shape)))
    qm = quantize_array(rows_first, spec, path, shape=shape, dtype=w.dtype)
    _replace(flat, path, qm, donate)
  for path in expert_paths(config):
    w = flat[path]
    if is_quantized(w):
      continue
    qm = quantize_stack(experts_out_in(np.asarray(w), path), spec, path,
                        shape=tuple(w.shape), dtype=w.dtype)
    _replace(flat, path, qm, donate)
  return unflatten(config, lambda path, _: flat[path])


def dequantize_params(config: Any, params: Any, *,
                      out_in: bool = False) -> dict[str, Any]:
  """The inverse of `quantize_params` up to the codes' rounding: every
  quantized matrix replaced by the float32 values it dequantises to (cast
  to its `dtype`), in its float layout ([I, O] projections, or [O, I]
  with `out_in`; [X, F, E] expert stacks); float parameters kept."""
  flat = flatten(params)
  transposed = set() if out_in else set(matrix_paths(config))
  for path, w in flat.items():
    if is_quantized(w):
      d = dequantize(w)  # [(X,) O, I]
      d = d.swapaxes(-1, -2) if path in transposed else experts_out_in(
          d, path)
      flat[path] = d.astype(w.dtype)
  return unflatten(config, lambda path, _: flat[path])


def _replace(flat: dict[str, Any], path: str, qm: QuantizedMatrix,
             donate: bool) -> None:
  """flat[path] = qm on the default device, the float array deleted with
  `donate`."""
  w, flat[path] = flat[path], jax.tree.map(jnp.asarray, qm)
  if donate and isinstance(w, jax.Array):
    w.delete()
