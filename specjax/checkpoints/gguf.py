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
permutation for the `llama` architecture (Mixtral included) and the +1 it
adds to every Gemma 3 norm scale (its converter stores Gemma's (1 + w) as
w + 1, as transformers' GGUF loader undoes too), and hands them to
`specjax.checkpoints.convert.params_from_tensors`, the one place that knows
how Hugging Face tensors map to specjax parameters.

Mixtures of experts: a `llama` file with `llama.expert_count` > 0 is
Mixtral, and `qwen2moe` (with its shared expert) and `qwen3moe` (q/k norms
per head) are their own architectures. Each layer's router
`ffn_gate_inp` [X, E] and stacked experts `ffn_gate_exps`, `ffn_up_exps`
[X, F, E] and `ffn_down_exps` [X, E, F] (numpy order) are already the
stacks `specjax.checkpoints.experts` makes of a Hugging Face checkpoint's
per-expert tensors, so they take those names.

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

from specjax import progress as progress_lib
from specjax.checkpoints import experts
from specjax.checkpoints import gguf_blocks
from specjax.checkpoints.gguf_reader import GGUFFile
from specjax.models import check_params
from specjax.models import LinearRopeScaling
from specjax.models import matrix_paths
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models import quantized
from specjax.models.config import expert_paths

GGMLQuantizationType = gguf.GGMLQuantizationType

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3", "qwen2moe",
                           "qwen3moe")
# Architectures whose Q and K rows llama.cpp permutes (`unpermute_qk`):
# specjax's names for `llama` files, dense or Mixtral.
_PERMUTED = ("llama", "mixtral")
# GGUF mixture-of-experts architectures -> specjax's (a `llama` file with
# experts is Mixtral), and whether llama.cpp renormalises the top-k
# weights when the file does not say (`expert_weights_norm`).
_MOE_ARCHS = {"llama": "mixtral", "qwen2moe": "qwen2_moe",
              "qwen3moe": "qwen3_moe"}
_MOE_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}

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
# Gemma 3's own layer tensors (its `ffn_norm` precedes the MLP, after the
# attention's post-norm).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# A mixture of experts' layer tensors: the router, the stacked experts
# (`experts.stack_experts`'s names), Qwen2-MoE's shared expert and its
# gate ([E] or [1, E]), Qwen3-MoE's q/k norms.
_MOE_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith("ffn_")},
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Gemma 3 hyper-parameters llama.cpp fixes in code rather than the file.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_THETA = 10000.0
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


def hf_name(gguf_name: str, arch: str = "llama") -> str:
  """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`.

  Args:
    gguf_name: the llama.cpp tensor name.
    arch: the specjax arch (`read_config`), which fixes the norms' and
      experts' names.

  Raises:
    ValueError: the tensor has no Hugging Face counterpart in `arch`.
  """
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  names = (_GEMMA3_LAYER_NAMES if arch == "gemma3" else _MOE_LAYER_NAMES
           if arch in experts.MOE_ARCHS else _LAYER_NAMES)
  m = _LAYER_RE.match(gguf_name)
  if m and m.group(2) in names:
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
  raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a {arch} "
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
  rope_scaling = None
  if scaling == "linear" and arch == "gemma3":
    rope_scaling = LinearRopeScaling(float(get("rope.scaling.factor")))
  elif scaling not in (None, "none"):
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
  intermediate = int(get("feed_forward_length"))
  moe = {}
  if arch in _MOE_ARCHS and (arch != "llama" or get(
      "expert_count", 0, required=False)):
    moe = _moe_fields(get, arch, tensors)
    intermediate = int(get("expert_feed_forward_length", intermediate,
                           required=False))
  gemma = {}
  if arch == "gemma3":
    # llama.cpp scales queries by head_dim ** -0.5 (27B aside), which is
    # query_pre_attn_scalar for 270M, 1B, 4B and 12B; local layers use a
    # base of 10000 and, unless the file says otherwise, 5 local : 1 global.
    gemma = dict(
        sliding_window=int(get("attention.sliding_window")),
        sliding_window_pattern=_window_pattern(
            get("attention.sliding_window_pattern", required=False),
            int(get("block_count"))),
        rope_local_theta=GEMMA3_ROPE_LOCAL_THETA, norm_plus_one=True,
        qk_norm=True, post_norms=True, activation="gelu_tanh",
        scale_embeddings=True, query_pre_attn_scalar=float(head_dim),
        final_logit_softcap=get("final_logit_softcapping", required=False))
  return ModelConfig(
      arch=_MOE_ARCHS[arch] if moe else arch,
      vocab_size=vocab_size,
      hidden_size=hidden,
      intermediate_size=intermediate,
      num_layers=int(get("block_count")),
      num_heads=num_heads,
      num_kv_heads=int(num_kv_heads),
      head_dim=head_dim,
      rope_theta=float(get("rope.freq_base", 10000.0)),
      rope_scaling=rope_scaling,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
      qkv_bias="blk.0.attn_q.bias" in tensors,
      tie_embeddings="output.weight" not in tensors,
      max_position_embeddings=int(get("context_length", 4096)),
      **gemma,
      **moe,
  )


def _moe_fields(get: Any, arch: str, tensors: Mapping[str, Any]
                ) -> dict[str, Any]:
  """The `ModelConfig` fields of a GGUF mixture of experts (`arch` the
  file's), routed as llama.cpp routes it: softmax over the experts, top-k,
  renormalised as `expert_weights_norm` says (else llama.cpp's default
  for the architecture).

  Args:
    get: reads `{arch}.{key}` metadata (`read_config`'s).
    arch: "llama" (Mixtral), "qwen2moe" or "qwen3moe".
    tensors: the file's tensors by GGUF name.

  Raises:
    ValueError: routing specjax does not run (sigmoid gating, scaled
      weights, grouped experts).
  """
  gating = get("expert_gating_func", None, required=False)
  if gating not in (None, int(gguf.ExpertGatingFuncType.SOFTMAX)):
    raise ValueError(f"GGUF {arch}.expert_gating_func={gating} (sigmoid) "
                     "is not supported: specjax routes by softmax.")
  scale = get("expert_weights_scale", None, required=False)
  if scale not in (None, 1.0) or get("expert_group_count", 0,
                                     required=False):
    raise ValueError(f"GGUF {arch} with scaled or grouped expert routing "
                     "is not supported.")
  fields = dict(
      num_experts=int(get("expert_count")),
      num_experts_per_tok=int(get("expert_used_count")),
      norm_topk_prob=bool(get("expert_weights_norm", _MOE_NORM_TOPK[arch],
                              required=False)),
      router_weights_float32=arch == "llama")
  shared = tensors.get("blk.0.ffn_gate_shexp.weight")
  if shared is not None:  # ne = [E, F_s]
    fields["shared_expert_size"] = int(get(
        "expert_shared_feed_forward_length", shared.shape[1],
        required=False))
  if arch == "qwen3moe":
    fields.update(qk_norm=True, qk_norm_per_head=True)
  return fields


def _window_pattern(value: Any, num_layers: int) -> int:
  """The local:global period from `attention.sliding_window_pattern`: a
  period, a per-layer list of booleans (True: sliding), or None (llama.cpp's
  Gemma 3 default, 6)."""
  if value is None:
    return GEMMA3_SLIDING_WINDOW_PATTERN
  if not isinstance(value, list):
    return int(value)
  sliding = [bool(v) for v in value][:num_layers]
  period = sliding.index(False) + 1 if False in sliding else num_layers + 1
  if len(sliding) != num_layers or sliding != [
      bool((i + 1) % period) for i in range(num_layers)]:
    raise ValueError(f"GGUF sliding_window_pattern {value} is not one "
                     "repeating local:global pattern (every n-th layer "
                     "global), the only layout specjax supports.")
  return period


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
    if name.endswith(".shared_expert_gate.weight") and self.ndim == 1:
      self.shape = (1, *self.shape)  # llama.cpp may store [E] for [1, E]

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def load(self) -> np.ndarray:
    """Dequantizes: [*shape] float32, Q/K permutation undone for llama,
    the +1 on norm scales for gemma3."""
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
    if c.arch in _PERMUTED:
      if ".q_proj." in self.name:
        w = unpermute_qk(w, c.num_heads)
      elif ".k_proj." in self.name:
        w = unpermute_qk(w, c.num_kv_heads)
    elif c.arch == "gemma3" and self.name.endswith("norm.weight"):
      w = w - np.float32(1.0)
    if self._on_load is not None:
      self._on_load()
    return w

  def blocks(self, transpose: bool, dtype: Any
             ) -> quantized.QuantizedMatrix | None:
    """The tensor's own blocks as a host `QuantizedMatrix` (Q/K rows
    unpermuted for llama), or None for a float tensor.

    Args:
      transpose: the parameter is [(X,) in, out] (a projection), so its
        logical shape is this tensor's with the last two axes swapped.
      dtype: the dequantised dtype.

    Raises:
      ValueError: a block type `gguf_blocks` cannot keep, naming the tensor.
    """
    t = self._tensor
    if t.tensor_type in _FLOAT_TYPES:
      return None
    shape = (*self.shape[:-2], *self.shape[:-3:-1]) if transpose else (
        self.shape)
    w = gguf_blocks.from_blocks(t.data, t.tensor_type, t.name, shape, dtype)
    heads = {".q_proj.": self._config.num_heads,
             ".k_proj.": self._config.num_kv_heads}
    for part, n in heads.items():
      if self._config.arch in _PERMUTED and part in self.name:
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
    self._bar = progress_lib.tqdm(total=len(reader.tensors),
                                  desc="dequantize GGUF", unit="tensor",
                                  disable=not progress)
    self._tensors = {}
    for t in reader.tensors:
      name = hf_name(t.name, config.arch)
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
  """Loads a Llama, Qwen2 or Gemma 3 GGUF file, or a Mixtral (`llama`
  with experts), Qwen2-MoE or Qwen3-MoE one.

  Args:
    path: the `.gguf` file.
    dtype: parameter dtype of the returned model (e.g. jnp.float32 on CPU,
      jnp.bfloat16 on accelerators).
    progress: show a tqdm bar while dequantizing.
    quantize: None dequantizes every tensor; "gguf" keeps the matrices'
      own blocks (`gguf_blocks`: Q4_K, Q5_0, Q6_K, Q8_0) as
      `QuantizedMatrix`es that dequantise to the same values bit for bit;
      "int8" / "int4" (`QuantSpec.parse`) dequantizes, then re-quantizes.
      A mixture of experts' stacked experts are kept as one stacked
      `QuantizedMatrix` each under "gguf" (`specjax.models.moe` reads
      only the experts a pass chose); its router and shared expert are
      matrices like any other.

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
    matrices = {"embed", *matrix_paths(config), *expert_paths(config)}
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
