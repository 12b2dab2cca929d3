"""Gemma 3 beyond the shared checkpoint tests: configs, clear errors for
what specjax does not run, and speculation on the tiny Gemma pair.

Shape letters: B batch, P prompt, V vocab.

Logits and greedy generation against transformers on the tiny random
Gemma3ForCausalLM live with the other architectures
(tests/test_hf_checkpoints.py, tests/test_generate_hf.py: 'gemma3').
"""

from __future__ import annotations

import json
import shutil

import pytest

from specjax.checkpoints import convert
from specjax.checkpoints import hf
from specjax.models import LinearRopeScaling
from specjax.models import ModelConfig
from specjax.models import tiny


def _text_config(**overrides):
  """A transformers 4 style gemma3_text config.json dict (Gemma 3 1B)."""
  config = {
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
      "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
      "num_hidden_layers": 26, "num_attention_heads": 4,
      "num_key_value_heads": 1, "head_dim": 256, "rope_theta": 1e6,
      "rope_local_base_freq": 10000.0, "sliding_window": 512,
      "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
      "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
      "final_logit_softcapping": None, "attn_logit_softcapping": None,
      "rope_scaling": None, "max_position_embeddings": 32768,
  }
  config.update(overrides)
  return config


def test_transformers_4_layout():
  c = convert.config_from_hf(_text_config())
  assert (c.arch, c.sliding_window, c.sliding_window_pattern) == (
      "gemma3", 512, 6)
  assert [i for i in range(26) if c.layer_window(i) is None] == [5, 11, 17,
                                                                 23]
  assert c.layer_rope(0) == (10000.0, None) and c.layer_rope(5) == (1e6, None)
  assert c.tie_embeddings and c.head_dim == 256 and c.num_kv_heads == 1
  assert (c.norm_plus_one, c.qk_norm, c.post_norms, c.scale_embeddings) == (
      True, True, True, True)
  assert c.activation == "gelu_tanh" and c.final_logit_softcap is None
  scaled = convert.config_from_hf(_text_config(
      rope_scaling={"rope_type": "linear", "factor": 8.0}))
  assert scaled.layer_rope(5) == (1e6, LinearRopeScaling(8.0))
  assert scaled.layer_rope(4) == (10000.0, None)


def test_config_round_trips_through_dict():
  for config in (tiny.TINY_GEMMA3_TARGET,
                 tiny.TINY_GEMMA3_TARGET.replace(
                     rope_scaling=LinearRopeScaling(8.0))):
    assert ModelConfig.from_dict(json.loads(json.dumps(
        config.to_dict()))) == config


def test_unsupported_gemma3_variants_name_the_problem():
  with pytest.raises(ValueError, match="vision_tower.*text-only Gemma 3"):
    convert.config_from_hf({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3", "text_config": _text_config(),
        "vision_config": {"model_type": "siglip_vision_model"}})
  with pytest.raises(ValueError, match="vision_tower.*Gemma3ForCausalLM"):
    convert.config_from_hf({"model_type": "gemma3",
                            "text_config": _text_config()})
  with pytest.raises(ValueError, match="attn_logit_softcapping"):
    convert.config_from_hf(_text_config(attn_logit_softcapping=50.0))
  with pytest.raises(ValueError, match="hidden_activation"):
    convert.config_from_hf(_text_config(hidden_activation="relu"))
  with pytest.raises(ValueError, match="one local:global pattern"):
    convert.config_from_hf(_text_config(
        num_hidden_layers=4, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention",
            "sliding_attention"]))
  with pytest.raises(ValueError, match="local layers with rope_type"):
    convert.config_from_hf(_text_config(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0}}))
  with pytest.raises(ValueError, match="sliding_window_pattern=3 needs"):
    tiny.TINY_GEMMA3_TARGET.replace(sliding_window=None)
  with pytest.raises(ValueError, match="Unknown activation"):
    tiny.TINY_GEMMA3_TARGET.replace(activation="relu")


def test_multimodal_checkpoint_is_refused(hf_checkpoint, tmp_path):
  src, _ = hf_checkpoint("gemma3")
  shutil.copytree(src, tmp_path / "ckpt")
  path = tmp_path / "ckpt" / "config.json"
  text = json.loads(path.read_text())
  path.write_text(json.dumps({
      "architectures": ["Gemma3ForConditionalGeneration"],
      "model_type": "gemma3", "text_config": text,
      "vision_config": {"model_type": "siglip_vision_model"}}))
  with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*"
                     "vision_tower.*not supported"):
    hf.load_hf(tmp_path / "ckpt")
