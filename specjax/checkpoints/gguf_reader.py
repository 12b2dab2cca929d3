"""A fast, read-only GGUF parser: metadata as Python values, tensors mmapped.

`gguf.GGUFReader` keeps every metadata element as its own numpy view, which
is slow for a vocabulary of hundreds of thousands of strings. This reader
decodes numeric arrays in one `np.frombuffer` and strings with `struct`.
Tensor data stays a memory map, laid out as `GGUFReader` lays it out, so
`gguf.quants.dequantize` accepts it.

Format (little-endian, version 2 or 3): magic `GGUF`, version u32, tensor
count u64, metadata count u64, metadata (key string, value type u32, value),
tensor infos (name, n_dims u32, ne u64 * n_dims, type u32, offset u64), then
the tensor data at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import gguf
import numpy as np

_SCALARS = {  # GGUFValueType -> struct format, numpy dtype
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16),
    3: ("<h", np.int16), 4: ("<I", np.uint32), 5: ("<i", np.int32),
    6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
    11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_DENSE = {  # tensor types stored as plain numpy elements
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of a GGUF file.

  Attributes:
    name: GGUF name, e.g. `blk.0.attn_q.weight`.
    shape: ggml `ne`, fastest-varying dimension first (numpy order reversed).
    tensor_type: the ggml type (F32, Q4_K, ...).
    data: memory-mapped numpy array: [*reversed(shape)] for dense types,
      [*reversed(shape)[:-1], bytes per row] uint8 for block-quantized ones.
  """

  name: str
  shape: tuple[int, ...]
  tensor_type: gguf.GGMLQuantizationType
  data: np.ndarray


class GGUFFile:
  """A GGUF file's metadata and (memory-mapped) tensors.

  Attributes:
    path: the file.
    version: GGUF format version.
    metadata: key -> str, int, float, bool or list of those.
    tensors: in file order.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if os.path.getsize(self.path) < 4:
      raise ValueError(f"{self.path} is not a GGUF file (too short for the "
                       "magic).")
    buf = np.memmap(self.path, dtype=np.uint8, mode="r")
    mv = memoryview(buf)
    if bytes(mv[:4]) != b"GGUF":
      raise ValueError(f"{self.path} is not a GGUF file (bad magic).")
    try:
      pos, infos = self._header(mv)
    except (struct.error, UnicodeDecodeError, OverflowError) as e:
      raise ValueError(f"{self.path} is a truncated or corrupt GGUF file: "
                       f"its header does not parse within its {len(buf)} "
                       f"bytes ({e}).") from None
    align = int(self.metadata.get("general.alignment", 32))
    start = -(-pos // align) * align
    self.tensors: list[Tensor] = []
    for name, ne, ttype, offset in infos:
      try:
        qtype = gguf.GGMLQuantizationType(ttype)
      except ValueError:
        raise ValueError(f"Unsupported GGUF quantization type id {ttype} "
                         f"(tensor {name}).") from None
      np_shape = tuple(reversed(ne))
      if qtype in _DENSE:
        dtype = np.dtype(_DENSE[qtype])
        n_bytes = int(np.prod(np_shape, dtype=np.int64)) * dtype.itemsize
      else:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
          raise ValueError(f"Tensor {name}: row of {ne[0]} is not a multiple "
                           f"of the {qtype.name} block size {block}.")
        dtype = np.dtype(np.uint8)
        np_shape = np_shape[:-1] + (ne[0] // block * type_size,)
        n_bytes = int(np.prod(np_shape, dtype=np.int64))
      begin = start + offset
      if begin + n_bytes > len(buf):
        raise ValueError(
            f"{self.path} is a truncated GGUF file: tensor {name} ends at "
            f"byte {begin + n_bytes}, but the file has {len(buf)} bytes.")
      data = buf[begin:begin + n_bytes].view(dtype).reshape(np_shape)
      self.tensors.append(Tensor(name, ne, qtype, data))

  def _header(self, mv: memoryview
              ) -> tuple[int, list[tuple[str, tuple[int, ...], int, int]]]:
    """Parses the version, metadata and tensor infos; returns the position
    after them and the infos (name, ne, type id, offset)."""
    self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", mv, 4)
    if self.version not in (2, 3):
      raise ValueError(f"{self.path}: unsupported GGUF version "
                       f"{self.version} (big-endian files are unsupported).")
    pos = 24
    self.metadata: dict[str, Any] = {}
    for _ in range(n_kv):
      key, pos = _string(mv, pos)
      (vtype,), pos = struct.unpack_from("<I", mv, pos), pos + 4
      self.metadata[key], pos = _value(mv, pos, vtype)
    infos = []
    for _ in range(n_tensors):
      name, pos = _string(mv, pos)
      (n_dims,), pos = struct.unpack_from("<I", mv, pos), pos + 4
      ne = struct.unpack_from(f"<{n_dims}Q", mv, pos)
      pos += 8 * n_dims
      ttype, offset = struct.unpack_from("<IQ", mv, pos)
      pos += 12
      infos.append((name, tuple(int(n) for n in ne), ttype, offset))
    return pos, infos

  def get(self, key: str, default: Any = None) -> Any:
    return self.metadata.get(key, default)


def _string(mv: memoryview, pos: int) -> tuple[str, int]:
  (n,) = struct.unpack_from("<Q", mv, pos)
  pos += 8
  if pos + n > len(mv):
    raise struct.error(f"a string of {n} bytes at byte {pos} runs past the "
                       "end")
  return bytes(mv[pos:pos + n]).decode("utf-8", errors="replace"), pos + n


def _value(mv: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
  if vtype == _STRING:
    return _string(mv, pos)
  if vtype in _SCALARS:
    fmt, _ = _SCALARS[vtype]
    return struct.unpack_from(fmt, mv, pos)[0], pos + struct.calcsize(fmt)
  if vtype == _ARRAY:
    etype, n = struct.unpack_from("<IQ", mv, pos)
    pos += 12
    if etype in _SCALARS:
      dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
      values = np.frombuffer(mv, dtype, n, pos).tolist()
      return values, pos + n * dtype.itemsize
    out = []
    for _ in range(n):
      v, pos = _value(mv, pos, etype)
      out.append(v)
    return out, pos
  raise ValueError(f"Unknown GGUF metadata value type {vtype}.")
