"""Hugging Face names and configs -> specjax `ModelConfig` and parameters
(Llama, Mistral, Qwen2 and Gemma 3 text; the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE and OLMoE).

Shared by every loader that can present its tensors under Hugging Face names:
`hf.py` reads them from safetensors, and a GGUF loader can rename llama.cpp
tensors to these names and reuse `config_from_hf` and `params_from_tensors`.

Shape letters (`specjax.shapes`): V vocab, E hidden size, F MLP size, H query
heads, K key/value heads, D head dim, X experts.

Hugging Face stores `nn.Linear` weights [out, in]; specjax stores matrices
[in, out] (see `specjax.models.config.param_shapes`), so every projection is
transposed on the way in. Embeddings stay [V, E]; `lm_head.weight` [V, E]
becomes `lm_head` [E, V]. A mixture of experts' per-expert tensors are
stacked per layer first (`specjax.checkpoints.experts`): X tensors
[out, in] become one [X, out, in] parameter, down's then transposed to
[X, in, out] (`specjax.models.moe`: all three [X, F, E]).
"""

from __future__ import annotations

from collections.abc import Mapping
import re
from typing import Any, Callable
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoints import experts
from specjax.models.config import check_params
from specjax.models.config import LinearRopeScaling
from specjax.models.config import ModelConfig
from specjax.models.config import param_shapes
from specjax.models.config import RopeScaling

# Hugging Face `architectures` entry -> specjax `ModelConfig.arch`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# `model_type` -> specjax arch, for configs without `architectures`.
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                "gemma3_text": "gemma3", "mixtral": "mixtral",
                "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                "olmoe": "olmoe"}
# Multimodal wrappers whose text decoder specjax could run, but whose
# checkpoints it does not read.
_MULTIMODAL = {"Gemma3ForConditionalGeneration": "gemma3"}

# Hugging Face defaults where a config.json leaves a field out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768,
                          "gemma3": 131072, "mixtral": 131072,
                          "qwen2_moe": 32768, "qwen3_moe": 32768,
                          "olmoe": 4096}

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
# Gemma 3 names its four layer norms differently: its
# `post_attention_layernorm` follows attention (Llama's precedes the MLP).
_GEMMA3_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items()
       if not k.startswith("post_attention")},
    "post_attention_layernorm.weight": ("attn_post_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("mlp_post_norm", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
}
# A mixture of experts' layer: attention as Llama's (biases with Qwen2-MoE,
# q/k norms with Qwen3-MoE and OLMoE), then the router, the experts
# stacked by `experts.stack_experts`, and Qwen2-MoE's shared expert.
_MOE_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if not k.startswith("mlp.")},
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate.weight": ("router", True),
    # Stacked F-major, [X, F, E] all three (`specjax.models.moe`).
    "mlp.experts.gate_proj": ("experts_gate", False),
    "mlp.experts.up_proj": ("experts_up", False),
    "mlp.experts.down_proj": ("experts_down", True),
    "mlp.shared_expert.gate_proj.weight": ("shared_gate", True),
    "mlp.shared_expert.up_proj.weight": ("shared_up", True),
    "mlp.shared_expert.down_proj.weight": ("shared_down", True),
    "mlp.shared_expert_gate.weight": ("shared_expert_gate", True),
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


def _layer_tensors(arch: str) -> dict[str, tuple[str, bool]]:
  if arch in experts.MOE_ARCHS:
    return _MOE_LAYER_TENSORS
  return _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS


def _hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
  """A specjax parameter's shape as the checkpoint holds it: the last two
  axes swapped for a transposed matrix ([in, out] or [X, in, out])."""
  shape = tuple(shape)
  return (*shape[:-2], shape[-1], shape[-2]) if transpose else shape


def hf_to_specjax(name: str, arch: str = "llama") -> tuple[str, bool] | None:
  """Maps a Hugging Face tensor name to a specjax parameter path.

  Args:
    name: e.g. `model.layers.3.self_attn.q_proj.weight`.
    arch: the specjax arch, which fixes the layer norms' names.

  Returns:
    (path, transpose), e.g. `('layers_3/q', True)`, where `path` joins the
    nested keys of the params pytree with '/' and `transpose` says the tensor
    is an [out, in] matrix to store [in, out]; or None for a name outside the
    Llama-family layout.
  """
  if name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[name]
  match = _LAYER_RE.fullmatch(name)
  layer_tensors = _layer_tensors(arch)
  if match and match.group(2) in layer_tensors:
    local, transpose = layer_tensors[match.group(2)]
    return f"layers_{int(match.group(1))}/{local}", transpose
  return None


def specjax_to_hf(path: str, arch: str = "llama") -> str:
  """The inverse of `hf_to_specjax`: `'layers_3/q'` -> its HF tensor name."""
  for name, (local, _) in _GLOBAL_TENSORS.items():
    if path == local:
      return name
  layer, _, local = path.partition("/")
  for suffix, (target, _) in _layer_tensors(arch).items():
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
  if arch == "gemma3":
    return _gemma3_config(config)

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

  moe_fields = (experts.config_fields(config, arch, num_layers)
                if arch in experts.MOE_ARCHS else {})
  act = get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"hidden_act={act!r} is not supported; specjax "
                     "implements SwiGLU (silu) MLPs only.")
  if get("mlp_bias", False):
    raise ValueError("mlp_bias=True is not supported (specjax MLPs have no "
                     "biases).")
  if arch == "qwen2":
    qkv_bias = True  # Qwen2 always biases q, k and v, never o.
  elif arch == "qwen2_moe":
    qkv_bias = bool(get("qkv_bias", True))  # q, k and v, never o.
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
      intermediate_size=int(required(
          "moe_intermediate_size" if arch in ("qwen2_moe", "qwen3_moe")
          else "intermediate_size")),
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
      **moe_fields,
  )


def _arch(config: Mapping[str, Any]) -> str:
  """The specjax arch of a HF config, from `architectures` or `model_type`."""
  names = config.get("architectures") or []
  if isinstance(names, str):
    names = [names]
  for name in names:
    if name in SUPPORTED_ARCHITECTURES:
      return SUPPORTED_ARCHITECTURES[name]
  for name in [*names, config.get("model_type")]:
    if name in experts.UNSUPPORTED:
      raise ValueError(
          f"{name} is a mixture of experts specjax does not run: it lacks "
          f"{experts.UNSUPPORTED[name]}. Supported mixtures of experts: "
          "Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.")
  multimodal = [n for n in names if n in _MULTIMODAL] or (
      ["Gemma3ForConditionalGeneration"] if config.get("model_type") ==
      "gemma3" and not names else [])
  if multimodal or "vision_config" in config:
    raise ValueError(
        f"{(multimodal or names)[0]} checkpoints (vision_tower, "
        "multi_modal_projector, language_model under model.) are not "
        "supported: specjax runs text-only Gemma 3. Load a "
        "Gemma3ForCausalLM checkpoint (model_type gemma3_text).")
  if not names and config.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[config["model_type"]]
  found = names or config.get("model_type")
  raise ValueError(
      f"Unsupported architecture {found!r}; specjax supports "
      f"{', '.join(SUPPORTED_ARCHITECTURES)}.")


def _rope(config: Mapping[str, Any], allow_linear: bool = False
          ) -> tuple[float, RopeScaling | LinearRopeScaling | None]:
  """(rope_theta, llama3 scaling, linear scaling if `allow_linear`, or None)
  from either config layout."""
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  theta = rope.get("rope_theta", config.get("rope_theta"))
  theta = 10000.0 if theta is None else float(theta)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type == "linear" and allow_linear:
    return theta, LinearRopeScaling(factor=float(rope["factor"]))
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


def _gemma3_config(config: Mapping[str, Any]) -> ModelConfig:
  """`config_from_hf` for a Gemma3ForCausalLM (gemma3_text) config.

  Reads both layouts: transformers 5 (`layer_types`, `rope_parameters` per
  layer type) and 4 (`sliding_window_pattern`, `rope_theta`,
  `rope_local_base_freq`, `rope_scaling` of the global layers).
  """

  def required(key):
    if config.get(key) is None:
      raise ValueError(f"Hugging Face config for gemma3 lacks {key!r}.")
    return config[key]

  act = config.get("hidden_activation") or config.get("hidden_act")
  if act not in (None, "gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"hidden_activation={act!r} is not supported for "
                     "gemma3; specjax implements GeGLU with gelu's tanh "
                     "approximation (gelu_pytorch_tanh).")
  for key in ("attention_bias", "use_bidirectional_attention"):
    if config.get(key):
      raise ValueError(f"Gemma 3 with {key}=True is not supported.")
  if config.get("attn_logit_softcapping") is not None:
    # transformers' Gemma3Attention ignores it; Google's gemma has none.
    raise ValueError(
        "Gemma 3 with attn_logit_softcapping="
        f"{config['attn_logit_softcapping']} is not supported: transformers "
        "does not apply it to Gemma 3, so its meaning is ambiguous.")
  num_layers = int(required("num_hidden_layers"))
  window = int(required("sliding_window"))
  pattern = _gemma3_pattern(config, num_layers)
  rope = config.get("rope_parameters") or {}
  if "full_attention" in rope or "sliding_attention" in rope:
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
  else:  # transformers 4
    full = dict(config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta"))
    local = {"rope_theta": config.get("rope_local_base_freq")}
  local_type = local.get("rope_type", local.get("type", "default"))
  if local_type != "default":
    raise ValueError(f"Gemma 3 local layers with rope_type {local_type!r} "
                     "are not supported (only 'default').")
  theta, scaling = _rope({"rope_parameters": full}, allow_linear=True)
  local_theta = local.get("rope_theta")
  final_cap = config.get("final_logit_softcapping")
  num_heads = int(required("num_attention_heads"))
  head_dim = int(config.get("head_dim") or 256)
  return ModelConfig(
      arch="gemma3",
      vocab_size=int(required("vocab_size")),
      hidden_size=int(required("hidden_size")),
      intermediate_size=int(required("intermediate_size")),
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
      head_dim=head_dim,
      rope_theta=1e6 if full.get("rope_theta") is None else theta,
      rope_scaling=scaling,
      rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
      tie_embeddings=bool(config.get("tie_word_embeddings", True)),
      sliding_window=window,
      max_position_embeddings=int(
          config.get("max_position_embeddings") or 131072),
      sliding_window_pattern=pattern,
      rope_local_theta=10000.0 if local_theta is None else float(local_theta),
      norm_plus_one=True, qk_norm=True, post_norms=True,
      activation="gelu_tanh", scale_embeddings=True,
      query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
      final_logit_softcap=None if final_cap is None else float(final_cap),
  )


def _gemma3_pattern(config: Mapping[str, Any], num_layers: int) -> int:
  """The local:global period of a Gemma 3 config's `layer_types` (or its
  `sliding_window_pattern`, default 6)."""
  types = config.get("layer_types")
  if types is None:
    return int(config.get("sliding_window_pattern") or 6)
  types = list(types)[:num_layers]
  if len(types) != num_layers or set(types) - {"sliding_attention",
                                               "full_attention"}:
    raise ValueError(f"Gemma 3 layer_types {types} must name "
                     f"'sliding_attention' or 'full_attention' for each of "
                     f"the {num_layers} layers.")
  globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
  pattern = globals_[0] + 1 if globals_ else num_layers + 1
  want = ["sliding_attention" if (i + 1) % pattern else "full_attention"
          for i in range(num_layers)]
  if types != want:
    raise ValueError(f"Gemma 3 layer_types {types} do not repeat one "
                     "local:global pattern (every n-th layer global), the "
                     "only layouts specjax supports.")
  return pattern


def _sliding_window(config: Mapping[str, Any], arch: str,
                    num_layers: int) -> int | None:
  """The sliding window of every layer, or None for full attention."""
  window = config.get("sliding_window")
  if arch == "llama" or window is None:
    return None
  if arch in ("mistral", "mixtral"):
    return int(window)  # transformers applies it to every layer.
  if not config.get("use_sliding_window", False):
    return None
  if arch == "qwen3_moe":
    return int(window)  # every layer, when use_sliding_window
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
  arch = config.arch
  if config.num_experts:
    tensors = experts.stack_experts(tensors)
  for name in tensors:
    if _IGNORED_RE.fullmatch(name):
      continue
    target = hf_to_specjax(name, arch)
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
    want = _hf_shape(expected[path], transpose)
    if shape != tuple(want):
      problems.append(
          f"tensor {name!r} has shape {shape}, expected {tuple(want)} "
          f"(specjax {path!r} {expected[path]}"
          f"{', transposed' if transpose else ''})")
  for path, shape in expected.items():
    if path not in sources:
      name = specjax_to_hf(path, arch)
      hf_shape = _hf_shape(shape, hf_to_specjax(name, arch)[1])
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
      array = np.swapaxes(array, -1, -2)  # [(X,) out, in] -> [(X,) in, out]
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
