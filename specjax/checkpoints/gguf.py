"""GGUF (llama.cpp) checkpoints -> `specjax.models.Model`.

Shape letters (`specjax.shapes`): V vocab, E hidden size, F MLP size, H query
heads, K key/value heads, D head dim.

A GGUF file stores each tensor's dimensions as ggml's `ne`, fastest-varying
first, i.e. reversed with respect to numpy: a PyTorch `[out, in]` weight is
`ne = [in, out]`. `GGUFReader` already exposes the data in numpy order
(`[out, in]`, quantized tensors as `[out, bytes per row]` uint8), and
`gguf.quants.dequantize` returns `[out, in]` float32, the layout of the
Hugging Face checkpoint the file was converted from. So this loader renames
the tensors to their Hugging Face names, undoes llama.cpp's Q/K row
permutation for the `llama` architecture, and hands them to
`specjax.checkpoints.convert.params_from_tensors`, the one place that knows
how Hugging Face tensors map to specjax parameters.

Tensors are dequantized lazily, one at a time, as the converter asks for
them (their shapes are known from the header), so the peak host memory stays
near one copy of the weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import os
import re
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from specjax.checkpoints import gguf_blocks
from specjax.checkpoints.gguf_reader import GGUFFile
from specjax.models import check_params
from specjax.models import matrix_paths
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models import quantized

GGMLQuantizationType = gguf.GGMLQuantizationType

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# Per-layer GGUF tensor names -> Hugging Face names (`{i}` is the layer).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                GGMLQuantizationType.F64, GGMLQuantizationType.BF16)


def supported_quantization_types() -> frozenset[GGMLQuantizationType]:
  """Tensor types this loader can dequantize (whatever `gguf` implements)."""
  # `gguf.quants` registers one class per implemented block format.
  traits = getattr(gguf.quants, "_type_traits", {})
  return frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                    GGMLQuantizationType.F64, *traits})


def hf_name(gguf_name: str) -> str:
  """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`.

  Raises:
    ValueError: the tensor has no Hugging Face Llama/Qwen2 counterpart.
  """
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  m = _LAYER_RE.match(gguf_name)
  if m and m.group(2) in _LAYER_NAMES:
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
  raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama/Qwen2 "
                   "decoder that specjax supports.")


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's rotary row permutation of a Q or K projection.

  llama.cpp's converter (`LlamaModel.permute` in convert_hf_to_gguf.py)
  reorders each head's rows from Hugging Face's rotate-halves layout to
  interleaved pairs: `w.reshape(n, 2, R // n // 2, *rest).swapaxes(1, 2)`.
  This is its inverse.

  Args:
    w: [R, ...] weight ([R, E]) or bias ([R]) in Hugging Face row order
      after llama.cpp's permutation, R = num_heads * D.
    num_heads: H for the query projection, K for the key projection.

  Returns:
    [R, ...] in Hugging Face's row order.
  """
  rows = w.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(f"Cannot unpermute {rows} rows into {num_heads} heads "
                     "of an even head dim.")
  return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def read_config(reader: GGUFFile) -> ModelConfig:
  """The `ModelConfig` described by a GGUF file's metadata.

  Raises:
    ValueError: unsupported architecture or rope variant, or missing keys.
  """
  arch = reader.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"Unsupported GGUF architecture {arch!r}; specjax loads "
                     f"{SUPPORTED_ARCHITECTURES}.")

  def get(key, default=None, required=True):
    value = reader.get(f"{arch}.{key}", default)
    if value is None and required:
      raise ValueError(f"GGUF metadata lacks {arch}.{key}.")
    return value

  tensors = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in tensors:
    raise ValueError("GGUF file has no token_embd.weight tensor.")
  if "rope_freqs.weight" in tensors:
    raise ValueError("GGUF file carries rope_freqs.weight (Llama 3.1-style "
                     "rope scaling), which the GGUF loader does not support; "
                     "load the Hugging Face checkpoint instead.")
  scaling = get("rope.scaling.type", required=False)
  if scaling not in (None, "none"):
    raise ValueError(f"Unsupported GGUF rope scaling type {scaling!r}.")

  hidden = int(get("embedding_length"))
  num_heads = int(get("attention.head_count"))
  num_kv_heads = get("attention.head_count_kv", num_heads)
  if isinstance(num_kv_heads, list):  # per-layer counts
    if len(set(num_kv_heads)) != 1:
      raise ValueError("Per-layer key/value head counts are unsupported.")
    num_kv_heads = num_kv_heads[0]
  head_dim = int(get("attention.key_length", hidden // num_heads))
  rope_dim = int(get("rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise ValueError(f"Partial rotary embeddings (rope dim {rope_dim} < head "
                     f"dim {head_dim}) are unsupported.")
  # ne = [E, V]: the vocabulary is the embedding's slow (second) dimension.
  vocab_size = int(tensors["token_embd.weight"].shape[1])
  return ModelConfig(
      arch=arch,
      vocab_size=vocab_size,
      hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length")),
      num_layers=int(get("block_count")),
      num_heads=num_heads,
      num_kv_heads=int(num_kv_heads),
      head_dim=head_dim,
      rope_theta=float(get("rope.freq_base", 10000.0)),
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
      qkv_bias="blk.0.attn_q.bias" in tensors,
      tie_embeddings="output.weight" not in tensors,
      max_position_embeddings=int(get("context_length", 4096)),
  )


class LazyTensor:
  """One GGUF tensor in Hugging Face layout, dequantized by `np.asarray`.

  `shape` is free (it comes from the header), so a converter can check every
  shape before paying for any dequantization.

  Attributes:
    name: the Hugging Face name.
    shape: numpy shape (ggml's `ne` reversed), e.g. [out, in] for weights.
    dtype: float32, the dtype `np.asarray` returns.
  """

  dtype = np.dtype(np.float32)

  def __init__(self, tensor: Any, name: str, config: ModelConfig,
               on_load: Any = None):
    self._tensor = tensor
    self._config = config
    self._on_load = on_load
    self.name = name
    self.shape = tuple(reversed([int(n) for n in tensor.shape]))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def load(self) -> np.ndarray:
    """Dequantizes: [*shape] float32, Q/K permutation undone for llama."""
    t = self._tensor
    try:
      if t.tensor_type == GGMLQuantizationType.F64:
        w = np.asarray(t.data, np.float32)
      else:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
      raise ValueError(f"Unsupported GGUF quantization type "
                       f"{t.tensor_type.name} (tensor {t.name}).") from e
    # Quantized data comes as [rows, bytes per row]; restore the full shape.
    w = np.asarray(w, np.float32).reshape(self.shape)
    c = self._config
    if c.arch == "llama":
      if ".q_proj." in self.name:
        w = unpermute_qk(w, c.num_heads)
      elif ".k_proj." in self.name:
        w = unpermute_qk(w, c.num_kv_heads)
    if self._on_load is not None:
      self._on_load()
    return w

  def blocks(self, transpose: bool, dtype: Any
             ) -> quantized.QuantizedMatrix | None:
    """The tensor's own blocks as a host `QuantizedMatrix` (Q/K rows
    unpermuted for llama), or None for a float tensor.

    Args:
      transpose: the parameter is [in, out] (a projection), so its logical
        shape is this tensor's reversed.
      dtype: the dequantised dtype.

    Raises:
      ValueError: a block type `gguf_blocks` cannot keep, naming the tensor.
    """
    t = self._tensor
    if t.tensor_type in _FLOAT_TYPES:
      return None
    shape = self.shape[::-1] if transpose else self.shape
    w = gguf_blocks.from_blocks(t.data, t.tensor_type, t.name, shape, dtype)
    heads = {".q_proj.": self._config.num_heads,
             ".k_proj.": self._config.num_kv_heads}
    for part, n in heads.items():
      if self._config.arch == "llama" and part in self.name:
        # Rows are output channels in every packed array.
        w = jax.tree.map(lambda a, n=n: unpermute_qk(a, n), w)
    if self._on_load is not None:
      self._on_load()
    return w

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    del copy  # always a fresh array
    w = self.load()
    return w if dtype is None else w.astype(dtype, copy=False)


class HFTensors(Mapping):
  """A GGUF file's tensors by Hugging Face name, as `LazyTensor`s.

  Each `np.asarray(tensors[name])` dequantizes afresh (nothing is cached) and
  advances a progress bar.
  """

  def __init__(self, reader: GGUFFile, config: ModelConfig,
               progress: bool = True):
    bad = sorted({t.tensor_type.name for t in reader.tensors
                  if t.tensor_type not in supported_quantization_types()})
    if bad:
      raise ValueError(
          f"Unsupported GGUF quantization type(s) {bad}; the gguf package "
          f"can dequantize "
          f"{sorted(q.name for q in supported_quantization_types())}.")
    self._bar = tqdm.tqdm(total=len(reader.tensors), desc="dequantize GGUF",
                          unit="tensor", disable=not progress)
    self._tensors = {}
    for t in reader.tensors:
      name = hf_name(t.name)
      self._tensors[name] = LazyTensor(t, name, config, self._advance)

  def _advance(self) -> None:
    self._bar.update(1)
    if self._bar.n >= self._bar.total:
      self._bar.close()

  def __len__(self) -> int:
    return len(self._tensors)

  def __iter__(self) -> Iterator[str]:
    return iter(self._tensors)

  def __getitem__(self, name: str) -> LazyTensor:
    return self._tensors[name]

  def close(self) -> None:
    self._bar.close()


def load_gguf(path: str | os.PathLike, dtype: Any = jnp.float32,
              progress: bool = True, *, quantize: str | None = None) -> Model:
  """Loads a Llama or Qwen2 GGUF file.

  Args:
    path: the `.gguf` file.
    dtype: parameter dtype of the returned model (e.g. jnp.float32 on CPU,
      jnp.bfloat16 on accelerators).
    progress: show a tqdm bar while dequantizing.
    quantize: None dequantizes every tensor; "gguf" keeps the matrices'
      own blocks (`gguf_blocks`: Q4_K, Q5_0, Q6_K, Q8_0) as
      `QuantizedMatrix`es that dequantise to the same values bit for bit;
      "int8" / "int4" (`QuantSpec.parse`) dequantizes, then re-quantizes.

  Returns:
    A `Model` whose config comes from the file's metadata.

  Raises:
    ValueError: unsupported architecture, quantization type or tensor.
  """
  from specjax.checkpoints import convert  # pylint: disable=g-import-not-at-top

  spec = quantized.parse(quantize)
  reader = GGUFFile(path)
  config = read_config(reader)
  tensors = HFTensors(reader, config, progress=progress)
  keep = None
  if spec == "gguf":
    matrices = {"embed", *matrix_paths(config)}
    keep = lambda p, t, transpose: (t.blocks(transpose, dtype)
                                    if p in matrices else None)
  try:
    params = convert.params_from_tensors(config, tensors, dtype, keep=keep)
  finally:
    tensors.close()
  check_params(config, params)
  model = Model(config=config, params=params)
  if isinstance(spec, quantized.QuantSpec):
    model = model.quantize(spec, donate=True)
  return model
