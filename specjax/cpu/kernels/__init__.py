"""Native CPU kernels reached through `jax.ffi`, built on first use.

Shape letters (`specjax.shapes`): X rows (batch times chunk), I input
features, O output features.

`smallm_matmul(x [X, I], w [O, I]) -> [X, O]` is the few-row product that a
decode step (X = B) and a verification pass (X = B(γ+1)) spend their time in.
XLA CPU lowers a few-row dot to a GEMM that packs or re-reads the weight, so
on some CPUs a 5-row pass costs far more than a 1-row pass (BENCHMARKS.md
"Verification cost"). The kernel
(`smallm.cc`) reads each weight row once and applies it to all X rows.
`smallm_quantized` does the same from packed codes, with float or int8
activations (integer dot products, AVX-512 VNNI where present, AMX tiles
from 12 rows where the CPU and Linux grant them: `amx`).

The source ships with the package and is compiled once per machine with the
host's C++ compiler and `-march=native` into
`<cache root>/kernels/<hash>/` (`specjax.paths`), keyed by the source,
compiler, flags, JAX version and CPU model, then registered as an XLA FFI
target. Without a compiler, `available()` is False, and
`specjax.cpu.plans` then chooses among XLA formulations only.
`SPECJAX_NO_KERNELS=1` disables the kernels. The model reaches these
through `specjax.cpu.matmul.SMALLM` alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import hardware
from specjax import paths

__all__ = ["ACT_CHUNK", "KernelError", "MAX_ROWS", "amx", "available",
           "build", "quantized_format_ok", "smallm_matmul", "smallm_pick",
           "smallm_quantized", "smallm_quantized_pick", "source_hash"]

_SOURCE = pathlib.Path(__file__).with_name("smallm.cc")
_TARGET = "specjax_smallm_f32"
_QUANT_TARGET = "specjax_smallm_quant"
_PICK_TARGET = "specjax_smallm_pick"
_QUANT_PICK_TARGET = "specjax_smallm_quant_pick"
# -ffp-contract=off: a product and a sum fuse only where smallm.cc says so
# (madd), the same in every tile whatever the compiler's tuning.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17",
          "-shared", "-fPIC", "-w")
# Rows the kernel accepts in one call; larger products (prefill) go to XLA.
MAX_ROWS = 64
# Inputs per scale of int8 activations (smallm.cc's kChunk).
ACT_CHUNK = 64

_log = logging.getLogger(__name__)


class KernelError(RuntimeError):
  """A native kernel could not be built or loaded."""


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


@functools.cache
def source_hash() -> str:
  """A short hash of the kernel sources (a new kernel invalidates caches)."""
  return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


def _build_key(compiler: str) -> str:
  version = subprocess.run([compiler, "--version"], capture_output=True,
                           text=True, check=False).stdout
  parts = [_SOURCE.read_text(), version, " ".join(_FLAGS), jax.__version__,
           hardware.cpu_id()]
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@functools.cache
def build(cache_dir: str | None = None) -> pathlib.Path:
  """Compiles the kernel library once per machine and returns its path.

  Raises:
    KernelError: no C++ compiler, or compilation failed (the message carries
      the compiler's output).
  """
  compiler = _compiler()
  if compiler is None:
    raise KernelError("No C++ compiler (CXX, c++, g++ or clang++) found; "
                      "specjax falls back to XLA's matrix products.")
  out_dir = paths.cache_root(cache_dir) / "kernels" / _build_key(
      compiler)
  library = out_dir / "smallm.so"
  if library.is_file():
    return library
  out_dir.mkdir(parents=True, exist_ok=True)
  # Build beside the target and rename: concurrent builders never see a
  # half-written library.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o",
         tmp]
  _log.info("Building specjax kernels: %s", " ".join(cmd))
  result = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    os.unlink(tmp)
    raise KernelError(f"Compiling {_SOURCE.name} failed:\n{result.stderr}")
  os.replace(tmp, library)
  return library


@functools.cache
def _library() -> ctypes.CDLL:
  return ctypes.cdll.LoadLibrary(str(build()))


@functools.cache
def _register() -> None:
  library = _library()
  jax.ffi.register_ffi_target(
      _TARGET, jax.ffi.pycapsule(library.SpecjaxSmallM), platform="cpu")
  jax.ffi.register_ffi_target(
      _QUANT_TARGET, jax.ffi.pycapsule(library.SpecjaxSmallMQuant),
      platform="cpu")
  jax.ffi.register_ffi_target(
      _PICK_TARGET, jax.ffi.pycapsule(library.SpecjaxSmallMPick),
      platform="cpu")
  jax.ffi.register_ffi_target(
      _QUANT_PICK_TARGET, jax.ffi.pycapsule(library.SpecjaxSmallMQuantPick),
      platform="cpu")


@functools.cache
def available() -> bool:
  """Whether the kernels can run here (CPU backend, built and registered)."""
  if os.environ.get("SPECJAX_NO_KERNELS"):
    return False
  if jax.default_backend() != "cpu":
    return False
  try:
    _register()
  except (KernelError, OSError) as e:
    _log.warning("specjax kernels unavailable: %s", e)
    return False
  return True


def amx() -> bool:
  """Whether int8-activation products of 12 rows or more use AMX tiles here
  (Intel AMX-INT8: the build targets it and Linux grants its registers;
  SPECJAX_NO_AMX=1 turns it off). Every row stays bit for bit the same as
  without them."""
  if not available():
    return False
  return bool(_library().SpecjaxAmx())


def _require() -> None:
  """Raises KernelError unless the kernels can run here."""
  if not available():
    raise KernelError("The specjax CPU kernels are not available on this "
                      "machine (see the log); use an XLA matmul plan.")


def smallm_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [X, I] float32 times w [O, I] float32 (contracted on I) -> [X, O].

  Raises:
    KernelError: the kernels are not available here.
    ValueError: wrong dtypes, ranks or sizes.
  """
  _require()
  if x.dtype != jnp.float32 or w.dtype != jnp.float32:
    raise ValueError(f"smallm_matmul needs float32, got {x.dtype} and "
                     f"{w.dtype}.")
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"smallm_matmul needs x [X, I] and w [O, I], got "
                     f"{x.shape} and {w.shape}.")
  if x.shape[0] > MAX_ROWS:
    raise ValueError(f"smallm_matmul takes at most {MAX_ROWS} rows, got "
                     f"{x.shape[0]}.")
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(_TARGET, out)(x, w)


def smallm_pick(x: jax.Array, index: jax.Array,
                ws: tuple[jax.Array, ...] | jax.Array,
                in_out: bool = False) -> jax.Array:
  """x [X, I] float32 times ws[index] [O, I] float32 -> [X, O], any X.

  A loop's product: `ws` holds one matrix per layer (a layer loop,
  `Transformer._layer_loop`) or is one stack [L, O, I] (a mixture of
  experts' experts, `moe.experts_loop`), and the kernel reads the matrix
  `index` names where it lies, in passes of 64 rows; slicing a stacked
  array for XLA's dot would copy the matrix every step. Each output sums
  over I in one order whatever X, so a row's result does not depend on
  the other rows.

  Args:
    x: [X, I] float32.
    index: int32 scalar, the layer or expert (traced: the loop's counter).
    ws: L matrices [O, I] float32, or one array [L, O, I] float32.
    in_out: the matrices are stored [I, O] ([L, I, O]) instead.

  Raises:
    KernelError: the kernels are not available here.
    ValueError: wrong dtypes or shapes.
  """
  _require()
  stacked = not isinstance(ws, (tuple, list))
  mats = ((jax.ShapeDtypeStruct(ws.shape[1:], ws.dtype),) if stacked
          and ws.ndim == 3 else (ws,) if stacked else ws)
  shapes = {(w.shape, w.dtype) for w in mats}
  if (x.dtype != jnp.float32 or x.ndim != 2 or len(shapes) != 1
      or index.shape != ()):
    raise ValueError(f"smallm_pick needs x [X, I] float32, a scalar index "
                     f"and matrices of one shape, got x {x.dtype}{x.shape}, "
                     f"index {index.shape} and {sorted(map(str, shapes))}.")
  (shape, dtype), = shapes
  inputs = shape[0 if in_out else 1] if len(shape) == 2 else None
  if dtype != jnp.float32 or inputs != x.shape[1]:
    want = f"{x.shape[1]}, O" if in_out else f"O, {x.shape[1]}"
    raise ValueError(f"smallm_pick needs matrices [{want}] float32 or one "
                     f"stack [L, {want}], got "
                     f"{dtype}{ws.shape if stacked else shape}.")
  out = jax.ShapeDtypeStruct((x.shape[0], shape[1 if in_out else 0]),
                             jnp.float32)
  return jax.ffi.ffi_call(_PICK_TARGET, out)(
      x, index.astype(jnp.int32), *((ws,) if stacked else ws),
      in_out=np.int64(in_out))


def quantized_format_ok(bits: int, group: int, cols: int,
                        int8_activations: bool = False) -> bool:
  """Whether `smallm_quantized` takes codes of `bits` in groups of `group`
  over `cols` inputs: 4, 5, 6 or 8 bits, G a multiple of 16 (for nibbles
  16 or a multiple of 32: a group's two halves are 16-byte runs), G
  dividing I; with int8 activations, I a multiple of `ACT_CHUNK` and G 16,
  32 or a multiple of `ACT_CHUNK`."""
  if bits not in (4, 5, 6, 8) or group % 16 or cols % group or (
      bits < 8 and group != 16 and group % 32):
    return False
  return not int8_activations or (cols % ACT_CHUNK == 0 and (
      group in (16, 32) or group % ACT_CHUNK == 0))


def _two_level_ok(sub: jax.Array | None, sup: jax.Array | None,
                  dtypes: tuple[Any, ...]) -> bool:
  """Whether float scales (or mins) `sub` stand alone (sup None), or
  integer ones of `dtypes` take float16 factors sup [O, N // S]."""
  if sub is None or sup is None:
    return sup is None and (sub is None or jnp.issubdtype(sub.dtype,
                                                          jnp.floating))
  return (sub.dtype in dtypes and sup.dtype == jnp.float16
          and sup.ndim == 2 and sup.shape[0] == sub.shape[0]
          and 0 < sup.shape[1] and sub.shape[1] % sup.shape[1] == 0)


def _check_packed(caller: str, x: jax.Array, q: dict[str, Any],
                  int8_activations: bool,
                  too_many_rows: bool = False) -> None:
  """Raises ValueError unless x [X, I] float32 and the packed arrays of
  q (`smallm_quantized`'s keywords) make a `bits`-bit [O, I] matrix in
  groups of `group` the kernel takes."""
  codes, scales, high = q["codes"], q["scales"], q.get("high")
  bits, group = q["bits"], q["group"]
  cols = x.shape[1]
  per_byte = 1 if bits == 8 else 2
  high_bits = bits - 4 if bits in (5, 6) else 0
  if (x.dtype != jnp.float32 or too_many_rows
      or not quantized_format_ok(bits, group, cols, int8_activations)
      or codes.shape[1] * per_byte != cols
      or scales.shape != (codes.shape[0], cols // group)
      or not _two_level_ok(scales, q.get("super_scales"),
                           (jnp.int8, jnp.uint8))
      or not _two_level_ok(q.get("mins"), q.get("super_mins"),
                           (jnp.uint8,))
      or (high is None) != (not high_bits)
      or (high is not None
          and high.shape != (codes.shape[0], cols * high_bits // 8))):
    sup = q.get("super_scales")
    raise ValueError(f"{caller}: x {x.dtype}{x.shape}, codes "
                     f"{codes.shape}, high "
                     f"{None if high is None else high.shape}, scales "
                     f"{scales.dtype}{scales.shape}"
                     f"{'' if sup is None else f' by {sup.dtype}{sup.shape}'}"
                     f" do not make a {bits}-bit matrix of "
                     f"groups of {group}"
                     f"{' for int8 activations' if int8_activations else ''}"
                     ".")


# The array keywords of `smallm_quantized`'s packed matrix.
_PACKED = ("codes", "high", "scales", "mins", "super_scales", "super_mins")


def _kernel_scales(scales: jax.Array) -> jax.Array:
  """Scales as the kernel reads them: float16, float32 or (two-level)
  integer as stored, any other float type as float32."""
  if scales.dtype in (jnp.float16, jnp.float32, jnp.int8, jnp.uint8):
    return scales
  return scales.astype(jnp.float32)


def _operands(q: dict[str, Any]) -> tuple[jax.Array, ...]:
  """A packed matrix's buffers after its codes, as the kernel takes them:
  high, scales, mins, super_scales, super_mins (an absent one passes
  another buffer in its place, which the kernel does not read)."""
  scales = _kernel_scales(q["scales"])
  either = lambda a, b: b if a is None else a
  return (either(q.get("high"), q["codes"]), scales,
          either(q.get("mins"), scales), either(q.get("super_scales"), scales),
          either(q.get("super_mins"), scales))


def smallm_quantized(x: jax.Array, codes: jax.Array, scales: jax.Array,
                     mins: jax.Array | None, *, bits: int, group: int,
                     offset: int, high: jax.Array | None = None,
                     super_scales: jax.Array | None = None,
                     super_mins: jax.Array | None = None,
                     int8_activations: bool = False) -> jax.Array:
  """x [X, I] float32 times a packed matrix [O, I] -> [X, O] float32.

  The matrix is w[o, i] = (c[o, i] - offset) * scales[o, i // G]
  - mins[o, i // G] (`specjax.models.quantized`), with c = low | high << 4
  for 5- and 6-bit codes, and for two-level scales (the K-quants)
  scales[o, n] = super_scales[o, n // S] * sub-scale; the kernel reads each
  packed weight row once and applies it to all X rows.

  Args:
    x: [X, I] float32, X <= MAX_ROWS.
    codes: [O, I] int8 (bits 8) or [O, I // 2] uint8 nibbles (bits 4-6).
    scales: [O, I // G] float16 or float32 (read as stored), or int8 /
      uint8 sub-scales with super_scales.
    mins: [O, I // G] float32, uint8 sub-mins with super_mins, or None.
    bits: 4, 5, 6 or 8.
    group: G (`quantized_format_ok` says which).
    offset: subtracted from the codes.
    high: [O, I * (bits - 4) // 8] uint8 high bits for 5 and 6 bits.
    super_scales: [O, I // G // S] float16 factors of integer scales (S
      groups each), or None.
    super_mins: the same for integer mins, or None.
    int8_activations: quantize x's rows to int8 per chunk of `ACT_CHUNK`
      inputs (`specjax.models.quantized.quantize_activations`) and sum
      integer products (VNNI where the CPU has it; AMX tiles from 12
      rows, `amx`).

  Raises:
    KernelError: the kernels are not available here.
    ValueError: wrong dtypes or sizes.
  """
  _require()
  rows = x.shape[0]
  q = dict(codes=codes, scales=scales, mins=mins, high=high,
           super_scales=super_scales, super_mins=super_mins, bits=bits,
           group=group, offset=offset)
  _check_packed("smallm_quantized", x, q, int8_activations,
                rows > MAX_ROWS)
  out = jax.ShapeDtypeStruct((rows, codes.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(_QUANT_TARGET, out)(
      x, codes, *_operands(q),
      bits=np.int64(bits), group=np.int64(group), offset=np.int64(offset),
      has_mins=np.int64(mins is not None),
      act8=np.int64(int8_activations))


def smallm_quantized_pick(x: jax.Array, index: jax.Array,
                          layers: tuple[dict, ...] | dict, *,
                          int8_activations: bool = False) -> jax.Array:
  """x [X, I] float32 times packed matrix `index` -> [X, O], any X.

  `smallm_quantized` inside a layer loop, as `smallm_pick` is
  `smallm_matmul`'s: the kernel is handed every layer's buffers and reads
  the chosen layer's where they lie, in passes of 64 rows. Layers may
  differ in format (a GGUF file stores some layers' `v` in Q6_K, others in
  Q4_K). Or `layers` is one stacked matrix [L, O, I] of one format (a
  mixture of experts' experts), whose slab `index` the kernel reads in
  place; slicing it for the call would copy the expert every step.

  Args:
    x: [X, I] float32.
    index: int32 scalar, the layer or expert (traced: the loop's counter).
    layers: per layer, the keywords of `smallm_quantized` that describe its
      matrix: codes, scales, mins, high, super_scales, super_mins, bits,
      group, offset; or one such dict whose arrays all carry a leading [L]
      axis (codes [L, O, ...], scales [L, O, N], ...).
    int8_activations: as in `smallm_quantized`, for every layer.

  Raises:
    KernelError: the kernels are not available here.
    ValueError: a layer's (or an expert's) arrays do not make the format
      it names, or a stack's arrays do not share their leading L.
  """
  _require()
  if isinstance(layers, dict):  # one stack: check one expert's view
    arrays = {k: layers[k] for k in _PACKED if layers.get(k) is not None}
    shapes = {k: a.shape for k, a in arrays.items()}
    if (any(len(s) != 3 for s in shapes.values())
        or len({s[0] for s in shapes.values()}) != 1):
      raise ValueError(f"smallm_quantized_pick needs a stack's arrays all "
                       f"[L, O, ...] with one L, got {shapes}.")
    views = ({**layers, **{k: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                           for k, a in arrays.items()}},)
    layers = (layers,)
  else:
    views = layers
  for q in views:
    _check_packed("smallm_quantized_pick", x, q, int8_activations)
  if index.shape != () or len({q["codes"].shape[0] for q in views}) != 1:
    raise ValueError(f"smallm_quantized_pick needs a scalar index and "
                     f"layers of one output size, got index {index.shape} "
                     f"and {sorted({q['codes'].shape[0] for q in views})}.")
  rows = views[0]["codes"].shape[0]
  codes = [q["codes"] for q in layers]
  # Operand by operand (high, scales, ...), each layer's in turn.
  operands = [a for per in zip(*map(_operands, layers)) for a in per]
  attrs = {name: np.array([q[name] for q in layers], np.int64)
           for name in ("bits", "group", "offset")}
  out = jax.ShapeDtypeStruct((x.shape[0], rows), jnp.float32)
  return jax.ffi.ffi_call(_QUANT_PICK_TARGET, out)(
      x, index.astype(jnp.int32), *codes, *operands,
      has_mins=np.array([q["mins"] is not None for q in layers], np.int64),
      act8=np.int64(int8_activations), **attrs)
