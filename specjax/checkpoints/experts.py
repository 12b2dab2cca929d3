"""Mixture-of-experts tensors under Hugging Face names, stacked per layer.

Shape letters (`specjax.shapes`): X experts, E hidden size, F expert MLP
size.

Checkpoints store each expert's projections as their own tensors
(Mixtral: `model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight`, w3,
w2; Qwen-MoE and OLMoE: `model.layers.{i}.mlp.experts.{j}.gate_proj.weight`,
up_proj, down_proj, each [out, in]), or, as transformers 5 holds them in
memory, fused (`mlp.experts.gate_up_proj` [X, 2F, E], `mlp.experts.down_proj`
[X, E, F]). `stack_experts` presents either as one lazy tensor per layer
and projection, `model.layers.{i}.mlp.experts.gate_proj` [X, F, E],
`up_proj` [X, F, E] and `down_proj` [X, E, F], and renames Mixtral's
`block_sparse_moe.` to `mlp.`, so that `convert` maps one name to one
parameter as for dense models. `config_fields` reads the config fields
these models add to Llama's, and `UNSUPPORTED` names what other mixtures
of experts need.
"""

from __future__ import annotations

from collections.abc import Mapping
import re
from typing import Any

import numpy as np

__all__ = ["MOE_ARCHS", "UNSUPPORTED", "config_fields", "stack_experts"]

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Mixtures of experts specjax does not run (by `architectures` entry or
# `model_type`), and what it lacks for each.
_DEEPSEEK = ("multi-head latent attention (MLA: kv_lora_rank, q_lora_rank, "
             "qk_rope_head_dim), grouped routing (n_group, topk_group) "
             "scaled by routed_scaling_factor, and dense first layers "
             "(first_k_dense_replace)")
UNSUPPORTED = {
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK + ", with sigmoid scores and "
                             "e_score_correction_bias",
    "GptOssForCausalLM": "attention sinks, biased experts with a clamped "
                         "SwiGLU (swiglu_limit), alternating sliding "
                         "windows, and MXFP4 expert blocks",
    "Qwen3NextForCausalLM": "gated DeltaNet (linear attention) layers and "
                            "gated attention",
}
UNSUPPORTED.update({
    "deepseek_v2": UNSUPPORTED["DeepseekV2ForCausalLM"],
    "deepseek_v3": UNSUPPORTED["DeepseekV3ForCausalLM"],
    "gpt_oss": UNSUPPORTED["GptOssForCausalLM"],
    "qwen3_next": UNSUPPORTED["Qwen3NextForCausalLM"],
})


_PER_EXPERT_RE = re.compile(
    r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_FUSED_RE = re.compile(
    r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
# Per-expert tensor -> the stacked projection it belongs to.
_PROJECTION = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
               "gate_proj": "gate_proj", "up_proj": "up_proj",
               "down_proj": "down_proj"}


class _Stacked:
  """A lazy [X, out, in] stack of expert tensors, materialised by
  `np.asarray`.

  Attributes:
    parts: X tensors [out, in] (or lazy views), in expert order.
    shape: (X, out, in).
  """

  def __init__(self, parts: list[Any]):
    self.parts = parts
    self.shape = (len(parts), *tuple(parts[0].shape))

  def __array__(self, dtype=None, copy=None):
    del copy
    return np.stack([np.asarray(p) for p in self.parts]).astype(
        dtype or np.asarray(self.parts[0]).dtype, copy=False)


class _Half:
  """One half of a fused gate_up tensor [X, 2F, E] on its middle axis
  (gate first, as transformers' `chunk(2, dim=-1)` of the product)."""

  def __init__(self, fused: Any, second: bool):
    self.fused, self.second = fused, second
    x, two_f, e = fused.shape
    self.shape = (x, two_f // 2, e)

  def __array__(self, dtype=None, copy=None):
    del copy
    f = self.shape[1]
    half = np.asarray(self.fused)[:, f:] if self.second else (
        np.asarray(self.fused)[:, :f])
    return half if dtype is None else half.astype(dtype)


def stack_experts(tensors: Mapping[str, Any]) -> Mapping[str, Any]:
  """`tensors` with expert tensors stacked per layer and projection (see
  the module docstring); every other tensor as it is, Mixtral's
  `block_sparse_moe.` renamed `mlp.`.

  Raises:
    ValueError: a layer's experts are not numbered 0..X-1 for every
      projection, naming the missing tensors.
  """
  out: dict[str, Any] = {}
  found: dict[str, dict[int, tuple[str, Any]]] = {}
  for name in tensors:
    per_expert = _PER_EXPERT_RE.fullmatch(name)
    fused = _FUSED_RE.fullmatch(name)
    if per_expert:
      layer, index, proj = per_expert.groups()
      key = f"{layer}.mlp.experts.{_PROJECTION[proj]}"
      found.setdefault(key, {})[int(index)] = (name, tensors[name])
    elif fused and fused.group(2) == "gate_up_proj":
      layer = fused.group(1)
      out[f"{layer}.mlp.experts.gate_proj"] = _Half(tensors[name], False)
      out[f"{layer}.mlp.experts.up_proj"] = _Half(tensors[name], True)
    else:
      out[name.replace(".block_sparse_moe.", ".mlp.")] = tensors[name]
  # Every layer and projection has experts 0..X-1, X the largest seen.
  width = max((max(parts) + 1 for parts in found.values()), default=0)
  problems = []
  for key, parts in found.items():
    missing = sorted(set(range(width)) - set(parts))
    if missing:
      problems.append(f"{key}: experts {missing} missing (have "
                      f"{[parts[j][0] for j in sorted(parts)][:2]} ...)")
      continue
    out[key] = _Stacked([parts[j][1] for j in range(len(parts))])
  if problems:
    raise ValueError("Checkpoint experts are incomplete: "
                     + "; ".join(problems))
  return out


def config_fields(config: Mapping[str, Any], arch: str,
                num_layers: int) -> dict[str, Any]:
  """The `ModelConfig` fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
  config beyond Llama's, as transformers reads them.

  Raises:
    ValueError: a feature of the config specjax does not run (dense MLP
      layers between sparse ones, clipped q/k/v, biases on o), naming it.
  """
  def required(key):
    if config.get(key) is None:
      raise ValueError(f"Hugging Face config for {arch} lacks {key!r}.")
    return config[key]

  if arch in ("qwen2_moe", "qwen3_moe"):
    step = int(config.get("decoder_sparse_step") or 1)
    dense = [i for i in (config.get("mlp_only_layers") or [])
             if i < num_layers]
    if step != 1 or dense:
      raise ValueError(
          f"{arch} with dense MLP layers between its sparse ones "
          f"(decoder_sparse_step={step}, mlp_only_layers={dense}) is not "
          "supported: specjax runs every layer of a mixture of experts "
          "sparse.")
  if arch in ("qwen3_moe", "olmoe") and config.get("attention_bias"):
    raise ValueError(f"{arch} with attention_bias=True is not supported.")
  if config.get("clip_qkv") is not None:
    raise ValueError(f"{arch} with clip_qkv={config['clip_qkv']} is not "
                     "supported (specjax never clamps q, k and v).")
  fields = dict(
      # (transformers maps either key to the other, and saves either.)
      num_experts=int(config.get("num_local_experts")
                      or required("num_experts")),
      num_experts_per_tok=int(required("num_experts_per_tok")),
      # transformers' Mixtral router always renormalises the top-k.
      norm_topk_prob=arch == "mixtral" or bool(
          config.get("norm_topk_prob", False)),
      router_weights_float32=arch == "mixtral",
  )
  if arch == "qwen2_moe":
    fields["shared_expert_size"] = int(
        required("shared_expert_intermediate_size"))
  if arch in ("qwen3_moe", "olmoe"):
    # Qwen3-MoE normalises each head; OLMoE the whole projections.
    fields.update(qk_norm=True, qk_norm_per_head=arch == "qwen3_moe")
  return fields
