"""GGUF block formats -> `QuantizedMatrix`, exactly (no dequantisation).

Shape letters (`specjax.shapes`): O rows (output features), I row length
(input features), nb = I / block blocks per row.

A GGUF tensor of a block type holds each row as nb blocks of `type_size`
bytes (`GGUFFile` gives it as [O, nb * type_size] uint8). Each decoder
below reads one format's byte layout (ggml's `block_q8_0`, `block_q5_0`,
`block_q4_K`, `block_q6_K`) and repacks it as codes in natural element
order plus per-group scales (and mins), so that
`specjax.models.quantized.dequantize` computes, in float32 and in the same
order, what `gguf.quants.dequantize` computes: the values agree bit for bit
(`tests/test_quantized.py`).

Bytes per 256 weights, file -> repacked: Q8_0 272 -> 272; Q5_0 176 -> 176;
Q4_K 144 -> 148 (the 6-bit sub-block scales and mins one byte each);
Q6_K 210 -> 210. The K-quants keep their two-level scales: a group's scale
is its super-block's float16 d times its integer sub-scale (and its min
dmin times its sub-min), a float32 product that is exact (11 by at most 8
significant bits), so it equals the reference's wherever it is formed.
"""

from __future__ import annotations

from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from specjax.models.quantized import pack_high
from specjax.models.quantized import pack_nibbles
from specjax.models.quantized import QuantizedMatrix

Q = gguf.GGMLQuantizationType

__all__ = ["SUPPORTED", "from_blocks"]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
  """[O, nb, bytes] -> [O, nb] float16 read at byte `start` of each block."""
  return np.ascontiguousarray(blocks[..., start:start + 2]).view(
      np.float16)[..., 0]


def _q8_0(blocks: np.ndarray) -> dict[str, Any]:
  """34-byte blocks of 32: d f16, then 32 int8 codes; w = d * q."""
  rows = blocks.shape[0]
  codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
  return dict(low=codes.reshape(rows, -1), scales=_f16(blocks, 0),
              fmt="q8_0", bits=8, group=32)


def _q5_0(blocks: np.ndarray) -> dict[str, Any]:
  """22-byte blocks of 32: d f16, 32 high bits (u32 LE), 16 nibble bytes.

  Element e < 16 takes the low nibble of byte e, element e >= 16 the high
  nibble of byte e - 16; its fifth bit is bit e of the u32. w = d (q - 16).
  """
  rows, nb, _ = blocks.shape
  qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [O, nb, 1]
  bits = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [O, nb, 32]
  qs = blocks[..., 6:22]
  low = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [O, nb, 32]
  codes = (low | (bits.astype(np.uint8) << 4)).reshape(rows, nb * 32)
  return dict(low=pack_nibbles(codes, 32), high=pack_high(codes, 1),
              scales=_f16(blocks, 0), fmt="q5_0", bits=5, group=32,
              offset=16)


def _q4_k(blocks: np.ndarray) -> dict[str, Any]:
  """144-byte super-blocks of 256 = 8 sub-blocks of 32.

  d, dmin f16; 12 bytes of 6-bit sub-block scales and mins; 128 nibble
  bytes in four runs of 32, run r holding sub-block 2r in its low nibbles
  and 2r + 1 in its high ones. w = (d sc) q - (dmin m).
  """
  rows, nb, _ = blocks.shape
  s = blocks[..., 4:16]  # [O, nb, 12]
  sc = np.concatenate([s[..., 0:4] & 63,
                       (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
  m = np.concatenate([s[..., 4:8] & 63,
                      (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
  qs = blocks[..., 16:144].reshape(rows, nb, 4, 32)
  codes = np.stack([qs & 15, qs >> 4], axis=3)  # [O, nb, 4, 2, 32]
  codes = codes.reshape(rows, nb * 256)
  return dict(low=pack_nibbles(codes, 32), scales=sc.reshape(rows, nb * 8),
              mins=m.reshape(rows, nb * 8), super_scales=_f16(blocks, 0),
              super_mins=_f16(blocks, 2), fmt="q4_k", bits=4, group=32)


def _q6_k(blocks: np.ndarray) -> dict[str, Any]:
  """210-byte super-blocks of 256 in two halves of 128, then 16 groups.

  Bytes: 128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, d f16.
  In half h, element 64j + l (j < 2, l < 64) has the nibble j of low byte
  64h + l; element 32k + l (k < 4, l < 32) has bits 2k, 2k + 1 of high
  byte 32h + l as its bits 4 and 5. w = (d sc) (q - 32), one sc per 16.
  """
  rows, nb, _ = blocks.shape
  ql = blocks[..., 0:128].reshape(rows, nb, 2, 64)
  qh = blocks[..., 128:192].reshape(rows, nb, 2, 32)
  low = np.concatenate([ql & 15, ql >> 4], axis=-1)  # [O, nb, 2, 128]
  shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
  high = (qh[..., None, :] >> shifts) & 3  # [O, nb, 2, 4, 32]
  codes = low | (high.reshape(rows, nb, 2, 128) << 4)
  codes = codes.reshape(rows, nb * 256)
  sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)
  return dict(low=pack_nibbles(codes, 16), high=pack_high(codes, 2),
              scales=sc.reshape(rows, nb * 16), super_scales=_f16(blocks, 208),
              fmt="q6_k", bits=6, group=16, offset=32)


_DECODERS = {Q.Q8_0: _q8_0, Q.Q5_0: _q5_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
SUPPORTED = tuple(_DECODERS)


def from_blocks(data: np.ndarray, tensor_type: Q, name: str,
                shape: tuple[int, int], dtype: Any = jnp.float32
                ) -> QuantizedMatrix:
  """Repacks one GGUF tensor's blocks.

  Args:
    data: [O, nb * type_size] uint8, as `GGUFFile` maps it, or [X, O,
      nb * type_size] for a stack of experts (a stacked `QuantizedMatrix`).
    tensor_type: its ggml type.
    name: the tensor's GGUF name, for errors.
    shape: the logical parameter shape ([I, O] for a projection, [O, I]
      for the embedding).
    dtype: the dequantised dtype.

  Returns:
    A QuantizedMatrix of numpy arrays.

  Raises:
    ValueError: the block type is not one of `SUPPORTED`, or the data is
      not a matrix of whole blocks.
  """
  if tensor_type not in _DECODERS:
    raise ValueError(
        f"Tensor {name!r}: GGUF block type {tensor_type.name} cannot be "
        "kept as blocks (quantize='gguf' supports "
        f"{', '.join(q.name for q in SUPPORTED)}); load it with "
        "quantize=None, 'int8' or 'int4' instead.")
  _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
  data = np.asarray(data)
  if (data.ndim not in (2, 3) or data.dtype != np.uint8
      or data.shape[-1] % type_size):
    raise ValueError(f"Tensor {name!r}: expected [(experts,) rows, blocks "
                     f"* {type_size}] uint8 {tensor_type.name} data, got "
                     f"{data.dtype} {data.shape}.")
  lead = data.shape[:-1]
  fields = _DECODERS[tensor_type](
      data.reshape(-1, data.shape[-1] // type_size, type_size))
  # The decoders work on rows: give the packed arrays the stack's axes.
  fields = {k: v.reshape(*lead, v.shape[-1]) if isinstance(v, np.ndarray)
            else v for k, v in fields.items()}
  return QuantizedMatrix(shape=tuple(shape), dtype=jnp.dtype(dtype),
                         **fields)
