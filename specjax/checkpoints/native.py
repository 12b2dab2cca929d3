"""specjax's single-file checkpoint: the format registry models convert to.

A safetensors file that holds a `Model`'s params under their `flatten` paths
(`embed`, `layers_0/q`, ...), laid out as `param_shapes` (matrices [in, out]),
so loading renames, transposes and dequantizes nothing. The `ModelConfig` is
JSON in the safetensors metadata, next to a format tag:

  {"__metadata__": {"format": "specjax", "version": "1", "config": "{...}"},
   "embed": {"dtype": "F32", "shape": [V, E], "data_offsets": [0, 4VE]}, ...}

A quantized matrix (`Model.quantize`, a GGUF file's blocks) is stored as
its packed arrays, `<path>.low`, `<path>.scales`, ..., with its format
under the metadata's "quantized" ({path: {"fmt", "bits", ...}}; version
2), and loads as the same `QuantizedMatrix`.

Any safetensors reader can open the file. `load` reads each tensor with
unbuffered `readinto` calls straight into a 64-byte-aligned host buffer. XLA's
CPU client adopts such a buffer without copying it, so a CPU load costs one
pass over the file: memory speed when the page cache holds it, disk speed
otherwise (`scripts/bench_load.py`). Other backends copy it to the device.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.checkpoints.hf import check_quantize
from specjax.checkpoints.hf import DTYPES
from specjax.checkpoints.hf import read_header
from specjax.models import check_params
from specjax.models import is_quantized
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models import param_shapes
from specjax.models import QuantizedMatrix
from specjax.models.config import flatten
from specjax.models.config import unflatten

FORMAT = "specjax"
VERSION = 2  # 1: float matrices only; 2: quantized ones too
_PACKED = ("low", "high", "scales", "mins", "super_scales", "super_mins")
_STATIC = ("fmt", "bits", "group", "offset", "act_bits")
_ALIGN = 64  # bytes; XLA CPU aliases host buffers aligned this way
_CHUNK = 64 << 20  # bytes per read
_READERS = 16  # concurrent reads
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def save(model: Model, path: str | os.PathLike[str]) -> None:
  """Writes `model` to the file `path` (atomically: temp file, then rename).

  Args:
    model: the model; its params must match `model.config`.
    path: the file to write; its directory must exist.

  Raises:
    ValueError: the params do not match the config, or use a dtype that
      safetensors cannot store.
  """
  params = model.canonical_params()
  check_params(model.config, params)
  arrays, packed = {}, {}
  for name, x in flatten(params).items():
    if not is_quantized(x):
      arrays[name] = np.asarray(x)
      continue
    packed[name] = {**{k: getattr(x, k) for k in _STATIC},
                    "shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
    arrays.update({f"{name}.{k}": np.asarray(getattr(x, k))
                   for k in _PACKED if getattr(x, k) is not None})
  metadata = {"format": FORMAT, "version": str(2 if packed else 1),
              "config": json.dumps(model.config.to_dict())}
  if packed:
    metadata["quantized"] = json.dumps(packed)
  header: dict[str, Any] = {"__metadata__": metadata}
  offset = 0
  for name, x in arrays.items():
    if x.dtype not in _NAMES:
      raise ValueError(f"Parameter {name!r} has dtype {x.dtype}, which a "
                       "safetensors file cannot hold.")
    header[name] = {"dtype": _NAMES[x.dtype], "shape": list(x.shape),
                    "data_offsets": [offset, offset + x.nbytes]}
    offset += x.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
  path = os.fspath(path)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(len(blob).to_bytes(8, "little"))
      f.write(blob)
      for x in arrays.values():
        f.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def load(path: str | os.PathLike[str], dtype: Any = None, *,
         mesh: Any = None, split: bool = True,
         quantize: str | None = None) -> Model:
  """Reads a model written by `save`.

  Args:
    path: the checkpoint file.
    dtype: cast the params to this dtype; None keeps the stored dtypes.
    mesh: a `jax.sharding.Mesh` to place each tensor on as it is read
      (`specjax.sharding.placer`; `split=False` replicates), or None.
    split: with `mesh`, split the model (else replicate it).
    quantize: None, or "int8" / "int4" (`QuantSpec.parse`): weight-only
      quantize every matrix once read.

  Returns:
    The model, params on the default device or on `mesh`.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: `path` is not a complete specjax checkpoint (another
      safetensors file, a truncated file, a corrupt header, or tensors that
      do not match the stored config).
  """
  path = os.fspath(path)
  spec = check_quantize(quantize, repr(path), mesh)
  dtype = None if dtype is None else np.dtype(dtype)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"Checkpoint file {path!r} does not exist.")
  header, start, metadata = read_header(path)
  config = _config(path, metadata)
  packed = _packed(path, metadata)
  if packed and mesh is not None:
    raise ValueError(f"{path!r} holds quantized matrices, which are not "
                     "sharded: load it without a mesh.")
  names = set(flatten(param_shapes(config))) - set(packed)
  names |= {f"{p}.{k}" for p in packed for k in _PACKED
            if f"{p}.{k}" in header}
  missing, extra = sorted(names - set(header)), sorted(set(header) - names)
  if missing or extra:
    raise ValueError(f"{path!r} does not match its config: missing tensors "
                     f"{missing}, unexpected tensors {extra}.")

  targets = []  # (host buffer, file offset) of every tensor

  def host_buffer(name, shape=None):
    info = header[name]
    if shape is not None and tuple(info["shape"]) != tuple(shape):
      raise ValueError(f"Tensor {name!r} in {path!r} has shape "
                       f"{tuple(info['shape'])}, its config says {shape}.")
    x = _aligned_empty(tuple(info["shape"]), DTYPES[info["dtype"]])
    targets.append((x, start + info["data_offsets"][0]))
    return x

  def host_param(name, shape):
    if name not in packed:
      return host_buffer(name, shape)
    info = packed[name]
    return QuantizedMatrix(
        **{k: host_buffer(f"{name}.{k}") if f"{name}.{k}" in header
           else None for k in _PACKED},
        **{k: info[k] for k in _STATIC}, shape=tuple(info["shape"]),
        dtype=jnp.dtype(info["dtype"]))

  hosts = unflatten(config, host_param)
  check_params(config, hosts)
  _read_tensors(path, targets)

  def to_device(host):
    x = jax.tree.map(jax.device_put, host)  # no copy on CPU: aligned
    if dtype in (None, x.dtype):
      return x
    return x.astype(dtype)  # a quantized matrix: its dequantised dtype

  if mesh is None:
    params = jax.tree.map(to_device, hosts, is_leaf=is_quantized)
  else:
    place = sharding.placer(config, mesh, split=split)
    flat = flatten(hosts)
    cast = lambda x: x if dtype in (None, x.dtype) else x.astype(dtype)
    params = unflatten(config, lambda path, _: place(path, cast(flat[path])))
  model = Model(config=config, params=params, mesh=mesh)
  return model if spec is None else model.quantize(spec, donate=True)


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
  """Whether `path` is a complete file written by `save` (header checked)."""
  try:
    _, _, metadata = read_header(os.fspath(path))
    return metadata.get("format") == FORMAT
  except (OSError, ValueError):
    return False


def _config(path: str, metadata: dict[str, str]) -> ModelConfig:
  if metadata.get("format") != FORMAT:
    raise ValueError(f"{path!r} is a safetensors file but not a specjax "
                     "checkpoint (no 'format: specjax' metadata); Hugging "
                     "Face checkpoints load with specjax.checkpoints.load_hf.")
  try:
    version = int(metadata.get("version", "0"))
    fields = json.loads(metadata["config"])
  except (KeyError, ValueError) as e:
    raise ValueError(f"{path!r} has corrupt specjax metadata: {e!r}") from e
  if version > VERSION:
    raise ValueError(f"{path!r} is a version {version} specjax checkpoint; "
                     f"this specjax reads up to version {VERSION}.")
  try:
    return ModelConfig.from_dict(fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path!r} stores an invalid config: {e}") from e


def _packed(path: str, metadata: dict[str, str]) -> dict[str, Any]:
  """The "quantized" metadata: param path -> its `_STATIC` fields, shape
  and dtype ({} for a float checkpoint)."""
  try:
    return json.loads(metadata.get("quantized", "{}"))
  except ValueError as e:
    raise ValueError(f"{path!r} has corrupt quantized metadata: {e!r}"
                     ) from e


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialised C-contiguous array whose data is `_ALIGN`-aligned."""
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + _ALIGN, np.uint8)
  skip = -raw.ctypes.data % _ALIGN
  return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def _read_tensors(path: str, targets: list[tuple[np.ndarray, int]]) -> None:
  """Fills each (array, file offset) target from `path`.

  The reads are split into `_CHUNK`-byte pieces issued by `_READERS`
  threads: concurrent reads take a large file from disk several times
  faster than one sequential read.
  """
  pieces = []
  for array, offset in targets:
    view = memoryview(array.reshape(-1).view(np.uint8))
    for begin in range(0, len(view), _CHUNK):
      pieces.append((view[begin:begin + _CHUNK], offset + begin))

  def read(piece):
    view, offset = piece
    with open(path, "rb", buffering=0) as f:
      f.seek(offset)
      done = 0
      while done < len(view):  # the OS may return short reads
        n = f.readinto(view[done:])
        if not n:
          raise ValueError(f"{path!r} is truncated.")
        done += n

  with concurrent.futures.ThreadPoolExecutor(_READERS) as pool:
    for _ in pool.map(read, pieces):  # re-raises the first failure
      pass
