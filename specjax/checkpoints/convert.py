"""Hugging Face names and configs -> specjax `ModelConfig` and parameters.

Shared by every loader that can present its tensors under Hugging Face names:
`hf.py` reads them from safetensors, and a GGUF loader can rename llama.cpp
tensors to these names and reuse `config_from_hf` and `params_from_tensors`.

Shape letters (`specjax.shapes`): V vocab, E hidden size, F MLP size, H query
heads, K key/value heads, D head dim.

Hugging Face stores `nn.Linear` weights [out, in]; specjax stores matrices
[in, out] (see `specjax.models.config.param_shapes`), so every projection is
transposed on the way in. Embeddings stay [V, E]; `lm_head.weight` [V, E]
becomes `lm_head` [E, V].
"""

from __future__ import annotations

from collections.abc import Mapping
import re
from typing import Any, Callable
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import check_params
from specjax.models.config import ModelConfig
from specjax.models.config import param_shapes
from specjax.models.config import RopeScaling

# Hugging Face `architectures` entry -> specjax `ModelConfig.arch`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {arch: name for name, arch in SUPPORTED_ARCHITECTURES.items()}

# Hugging Face defaults where a config.json leaves a field out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}

# Per-layer tensor suffix -> (specjax name, whether to transpose [out, in]).
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("q", True),
    "self_attn.k_proj.weight": ("k", True),
    "self_attn.v_proj.weight": ("v", True),
    "self_attn.o_proj.weight": ("o", True),
    "self_attn.q_proj.bias": ("q_bias", False),
    "self_attn.k_proj.bias": ("k_bias", False),
    "self_attn.v_proj.bias": ("v_bias", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("gate", True),
    "mlp.up_proj.weight": ("up", True),
    "mlp.down_proj.weight": ("down", True),
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some older checkpoints carry; recomputed from the config.
_IGNORED_RE = re.compile(r".*\.rotary_emb\.inv_freq")
_MAX_PROBLEMS = 20


def hf_to_specjax(name: str) -> tuple[str, bool] | None:
  """Maps a Hugging Face tensor name to a specjax parameter path.

  Args:
    name: e.g. `model.layers.3.self_attn.q_proj.weight`.

  Returns:
    (path, transpose), e.g. `('layers_3/q', True)`, where `path` joins the
    nested keys of the params pytree with '/' and `transpose` says the tensor
    is an [out, in] matrix to store [in, out]; or None for a name outside the
    Llama-family layout.
  """
  if name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[name]
  match = _LAYER_RE.fullmatch(name)
  if match and match.group(2) in _LAYER_TENSORS:
    local, transpose = _LAYER_TENSORS[match.group(2)]
    return f"layers_{int(match.group(1))}/{local}", transpose
  return None


def specjax_to_hf(path: str) -> str:
  """The inverse of `hf_to_specjax`: `'layers_3/q'` -> its HF tensor name."""
  for name, (local, _) in _GLOBAL_TENSORS.items():
    if path == local:
      return name
  layer, _, local = path.partition("/")
  for suffix, (target, _) in _LAYER_TENSORS.items():
    if local == target and layer.startswith("layers_"):
      return f"model.layers.{layer[len('layers_'):]}.{suffix}"
  raise KeyError(f"No Hugging Face name for specjax parameter {path!r}.")


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
  """Builds a `ModelConfig` from a Hugging Face `config.json` dict.

  Understands both the transformers 4 layout (`rope_theta`, `rope_scaling`)
  and the transformers 5 one (`rope_parameters`).

  Args:
    config: the parsed `config.json` of a LlamaForCausalLM,
      MistralForCausalLM or Qwen2ForCausalLM checkpoint.

  Returns:
    The equivalent specjax config.

  Raises:
    ValueError: for an unknown architecture, a missing required field, or a
      feature specjax does not implement (a rope type other than llama3,
      biases outside q/k/v, a non-SiLU MLP, sliding windows on only some
      layers).
  """
  arch = _arch(config)

  def get(key, default=None):
    value = config.get(key)
    return default if value is None else value

  def required(key):
    if config.get(key) is None:
      raise ValueError(f"Hugging Face config for {arch} lacks {key!r}.")
    return config[key]

  hidden = int(required("hidden_size"))
  num_heads = int(required("num_attention_heads"))
  num_layers = int(required("num_hidden_layers"))

  act = get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"hidden_act={act!r} is not supported; specjax "
                     "implements SwiGLU (silu) MLPs only.")
  if get("mlp_bias", False):
    raise ValueError("mlp_bias=True is not supported (specjax MLPs have no "
                     "biases).")
  if arch == "qwen2":
    qkv_bias = True  # Qwen2 always biases q, k and v, never o.
  elif get("attention_bias", False):
    raise ValueError("attention_bias=True (biases on q, k, v and o_proj) is "
                     "not supported; specjax has q/k/v biases only (Qwen2).")
  else:
    qkv_bias = False

  theta, scaling = _rope(config)
  return ModelConfig(
      arch=arch,
      vocab_size=int(required("vocab_size")),
      hidden_size=hidden,
      intermediate_size=int(required("intermediate_size")),
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=int(get("num_key_value_heads", num_heads)),
      head_dim=int(get("head_dim", hidden // num_heads)),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
      qkv_bias=qkv_bias,
      tie_embeddings=bool(get("tie_word_embeddings", False)),
      sliding_window=_sliding_window(config, arch, num_layers),
      max_position_embeddings=int(
          get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])),
  )


def _arch(config: Mapping[str, Any]) -> str:
  """The specjax arch of a HF config, from `architectures` or `model_type`."""
  names = config.get("architectures") or []
  if isinstance(names, str):
    names = [names]
  for name in names:
    if name in SUPPORTED_ARCHITECTURES:
      return SUPPORTED_ARCHITECTURES[name]
  if not names and config.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[config["model_type"]]
  found = names or config.get("model_type")
  raise ValueError(
      f"Unsupported architecture {found!r}; specjax supports "
      f"{', '.join(SUPPORTED_ARCHITECTURES)}.")


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """(rope_theta, llama3 scaling or None) from either config layout."""
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  theta = rope.get("rope_theta", config.get("rope_theta"))
  theta = 10000.0 if theta is None else float(theta)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ValueError(
        f"Unsupported rope_type {rope_type!r}; specjax supports 'default' "
        "and 'llama3' rope scaling.")
  try:
    scaling = RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope["original_max_position_embeddings"]))
  except KeyError as e:
    raise ValueError(f"llama3 rope scaling lacks {e.args[0]!r}.") from None
  return theta, scaling


def _sliding_window(config: Mapping[str, Any], arch: str,
                    num_layers: int) -> int | None:
  """The sliding window of every layer, or None for full attention."""
  window = config.get("sliding_window")
  if arch == "llama" or window is None:
    return None
  if arch == "mistral":
    return int(window)  # transformers applies it to every Mistral layer.
  if not config.get("use_sliding_window", False):
    return None
  # Qwen2 slides only in the layers from `max_window_layers` on.
  types = config.get("layer_types") or [
      "sliding_attention" if i >= config.get("max_window_layers", 28)
      else "full_attention" for i in range(num_layers)]
  sliding = [t == "sliding_attention" for t in types[:num_layers]]
  if all(sliding):
    return int(window)
  if not any(sliding):
    return None
  raise ValueError(
      f"Qwen2 with sliding_window={window} on only some layers ({types}) is "
      "not supported; specjax uses one window for all layers.")


def params_from_tensors(config: ModelConfig,
                        tensors: Mapping[str, np.ndarray],
                        dtype: Any = jnp.float32,
                        place: Callable[[str, np.ndarray], jax.Array]
                        | None = None,
                        keep: Callable[[str, Any, bool], Any]
                        | None = None) -> dict[str, Any]:
  """Builds the specjax params pytree from Hugging Face-named tensors.

  Every shape is checked before any tensor is converted, so a mismatched
  checkpoint fails fast. Tensors are read one at a time (`tensors` may be a
  lazy mapping over memory-mapped files), cast and transposed on the host,
  then moved to the default device.

  Args:
    config: the model the tensors belong to.
    tensors: HF tensor name -> array, e.g. `model.embed_tokens.weight` [V, E],
      `model.layers.{i}.self_attn.q_proj.weight` [H*D, E]. Values may be lazy:
      anything with a `shape` that `np.asarray` materialises, which happens
      once per tensor, after all shapes have been checked.
    dtype: dtype of the returned parameters.
    place: `place(path, host_array)` puts one parameter on its devices
      (`specjax.sharding.placer`: each device receives only its shard);
      default the default device.
    keep: `keep(path, tensor, transpose)` returns the parameter to use as
      is (e.g. a `QuantizedMatrix` of the file's own blocks, on the host),
      or None to convert the tensor as usual; `transpose` says the tensor is
      [out, in] for an [in, out] parameter.

  Returns:
    The params pytree laid out as `param_shapes(config)`.

  Raises:
    ValueError: naming (by HF name and specjax path) every missing,
      unexpected or misshapen tensor.
  """
  expected = {}  # specjax path -> specjax shape
  for key, value in param_shapes(config).items():
    if isinstance(value, dict):
      expected.update({f"{key}/{k}": v for k, v in value.items()})
    else:
      expected[key] = value

  sources = {}  # specjax path -> (HF name, transpose)
  problems = []
  for name in tensors:
    if _IGNORED_RE.fullmatch(name):
      continue
    target = hf_to_specjax(name)
    if target is None or target[0] not in expected:
      if name == "lm_head.weight" and config.tie_embeddings:
        _check_tied_head(tensors)
        continue
      why = ("not a Llama-family tensor" if target is None else
             f"no specjax parameter {target[0]!r} in this {config.arch} "
             "config")
      problems.append(f"unexpected tensor {name!r} ({why})")
      continue
    path, transpose = target
    sources[path] = (name, transpose)
    shape = tuple(tensors[name].shape)
    want = expected[path][::-1] if transpose else expected[path]
    if shape != tuple(want):
      problems.append(
          f"tensor {name!r} has shape {shape}, expected {tuple(want)} "
          f"(specjax {path!r} {expected[path]}"
          f"{', transposed' if transpose else ''})")
  for path, shape in expected.items():
    if path not in sources:
      name = specjax_to_hf(path)
      hf_shape = shape[::-1] if hf_to_specjax(name)[1] else shape
      problems.append(f"missing tensor {name!r} (shape {hf_shape}, specjax "
                      f"{path!r})")
  if problems:
    more = len(problems) - _MAX_PROBLEMS
    raise ValueError(
        f"Checkpoint tensors do not match the {config.arch} config "
        f"({len(problems)} problem(s)): "
        + "; ".join(problems[:_MAX_PROBLEMS])
        + (f"; ... and {more} more" if more > 0 else ""))

  np_dtype = np.dtype(jnp.dtype(dtype))
  params: dict[str, Any] = {}
  for path, (name, transpose) in sources.items():
    kept = None if keep is None else keep(path, tensors[name], transpose)
    if kept is not None:
      head, _, leaf = path.rpartition("/")
      (params.setdefault(head, {}) if head else params)[leaf] = jax.tree.map(
          jnp.asarray, kept)
      continue
    array = np.asarray(tensors[name])
    if transpose:
      array = array.T  # [out, in] -> [in, out]
    # Always a fresh host copy: jax may alias host memory on CPU, and the
    # input can be a memory-mapped file that is later rewritten.
    array = np.array(array, dtype=np_dtype, order="C")
    array = jnp.asarray(array) if place is None else place(path, array)
    head, _, leaf = path.rpartition("/")
    (params.setdefault(head, {}) if head else params)[leaf] = array
  check_params(config, params)
  return params


def _check_tied_head(tensors: Mapping[str, np.ndarray]) -> None:
  """Warns when a tied checkpoint's extra `lm_head.weight` is not the embed.

  transformers ties the head to the embedding after loading, so an extra
  head is ignored either way; a different one means the checkpoint's config
  and weights disagree.
  """
  head = tensors["lm_head.weight"]
  embed = tensors.get("model.embed_tokens.weight")
  if embed is None or head.shape != embed.shape or not np.array_equal(
      np.asarray(head), np.asarray(embed)):
    warnings.warn(
        "tie_word_embeddings=True but the checkpoint's lm_head.weight differs "
        "from model.embed_tokens.weight; using the embedding, as "
        "transformers does.", stacklevel=3)
