"""Hugging Face safetensors loading, HF config mapping and orbax round trips.

Shape letters: B batch, P padded prompt, T chunk, S cache size, V vocab.

The reference is transformers itself (float32, eager attention) on the tiny
random checkpoints of `conftest.hf_checkpoint`. Cached decoding is compared
with transformers' full forward: attention is causal, so the reference logits
at position p of a row depend only on its first p + 1 tokens.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save_file
import torch

from specjax import cpu
from specjax.checkpoints import convert
from specjax.checkpoints import hf
from specjax.checkpoints import orbax_io
from specjax.models import Model
from specjax.models import RopeScaling

ATOL = 1e-4
V = 128  # vocab of the tiny checkpoints
# One batch, prompt width and cache size for every test, so each jitted
# function compiles once per architecture.
B, P, S = 3, 12, 24


@pytest.fixture(scope="module")
def loaded(hf_checkpoint):
  """arch -> (specjax Model, torch model), each loaded once."""
  models = {}

  def get(arch, plan="in_out/xla"):
    if arch not in models:
      directory, torch_model = hf_checkpoint(arch)
      models[arch] = (hf.load_hf(directory), torch_model)
    model, torch_model = models[arch]
    return model.with_plan(cpu.plan(plan)), torch_model

  return get


# Every plan `specjax.cpu.plans` can pick (the kernel only where it can
# be built) must match transformers to the same tolerance.
PLANS = [p for p in cpu.plans.PLANS
         if "/xla" in p or cpu.SMALLM.available()]


@jax.jit
def _forward(model, tokens, cache):
  out, cache = model(tokens, cache)
  return out.logits, cache


@jax.jit
def _prefill(model, tokens, lengths, cache):
  return model.prefill(tokens, lengths, cache)


def _hf_logits(torch_model, tokens: np.ndarray) -> np.ndarray:
  """tokens [B, T] -> transformers logits [B, T, V] (no padding)."""
  with torch.no_grad():
    return torch_model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - b)))


def _right_pad(tokens: np.ndarray, lengths, rng) -> np.ndarray:
  """Replaces positions past each row's length with random junk tokens."""
  tokens = tokens.copy()
  for b, n in enumerate(lengths):
    tokens[b, n:] = rng.integers(0, V, tokens.shape[1] - n)
  return tokens


def _prefilled_sequences(model, torch_model, seed, lengths):
  """Random sequences, their reference logits, and a prefill of their prompts.

  Returns:
    seq [B, S], transformers' logits for it [B, S, V], and specjax's
    `prefill` of the first `lengths` [B] tokens of each row (right-padded
    with junk to P): last logits [B, V] and the cache.
  """
  rng = np.random.default_rng(seed)
  seq = rng.integers(0, V, (B, S))  # [B, S]
  prompt = _right_pad(seq[:, :P], lengths, rng)  # [B, P]
  last, cache = _prefill(model, jnp.asarray(prompt, jnp.int32),
                         jnp.asarray(lengths, jnp.int32),
                         model.init_cache(B, S))
  return seq, _hf_logits(torch_model, seq), last, cache


# ---------------------------------------------------------------------------
# Logits against transformers.


@pytest.mark.parametrize("plan", PLANS)
def test_full_forward_of_padded_prompts_matches_hf(loaded, hf_arch, plan):
  model, torch_model = loaded(hf_arch, plan)
  rng = np.random.default_rng(1)
  lengths = [12, 7, 3]  # longer and shorter than Mistral's window of 4
  tokens = _right_pad(rng.integers(0, V, (B, P)), lengths, rng)  # [B, P]
  logits, _ = _forward(model, jnp.asarray(tokens, jnp.int32),
                       model.init_cache(B, S))  # [B, P, V]
  last, cache = _prefill(model, jnp.asarray(tokens, jnp.int32),
                         jnp.asarray(lengths, jnp.int32),
                         model.init_cache(B, S))  # [B, V]
  np.testing.assert_array_equal(cache.lengths, lengths)
  for b, n in enumerate(lengths):
    ref = _hf_logits(torch_model, tokens[b:b + 1, :n])[0]  # [n, V]
    assert _max_diff(logits[b, :n], ref) <= ATOL, (b, n)
    assert _max_diff(last[b], ref[-1]) <= ATOL, (b, n)


@pytest.mark.parametrize("plan", PLANS)
def test_decode_one_token_at_a_time_matches_hf(loaded, hf_arch, plan):
  model, torch_model = loaded(hf_arch, plan)
  lengths = np.array([9, 5, 2])
  seq, ref, last, cache = _prefilled_sequences(model, torch_model, 2,
                                               lengths)
  rows = np.arange(B)
  assert _max_diff(last, ref[rows, lengths - 1]) <= ATOL
  for i in range(8):
    pos = lengths + i  # [B], each row at its own position
    logits, cache = _forward(model, jnp.asarray(seq[rows, pos][:, None],
                                                jnp.int32), cache)
    assert _max_diff(logits[:, 0], ref[rows, pos]) <= ATOL, i
  np.testing.assert_array_equal(cache.lengths, lengths + 8)


@pytest.mark.parametrize("plan", PLANS)
def test_decode_chunks_at_per_row_offsets_matches_hf(loaded, hf_arch, plan):
  model, torch_model = loaded(hf_arch, plan)
  lengths = np.array([11, 4, 1])
  seq, ref, _, cache = _prefilled_sequences(model, torch_model, 3, lengths)
  t = 3
  for j in range(3):
    pos = lengths[:, None] + j * t + np.arange(t)  # [B, T]
    chunk = np.take_along_axis(seq, pos, axis=1)
    logits, cache = _forward(model, jnp.asarray(chunk, jnp.int32), cache)
    want = np.take_along_axis(ref, pos[..., None], axis=1)  # [B, T, V]
    assert _max_diff(logits, want) <= ATOL, j


@pytest.mark.parametrize("arch,field,value", [
    ("llama", "rope_scaling", None),
    ("mistral", "sliding_window", None),
    ("gemma3", "sliding_window_pattern", None),  # every layer local
    ("gemma3", "rope_local_theta", None),  # local layers with global rope
    ("gemma3", "rope_scaling", None),
    ("gemma3", "query_pre_attn_scalar", None),
    ("gemma3", "final_logit_softcap", None),
    ("gemma3", "scale_embeddings", False),
])
def test_reference_depends_on_mapped_feature(loaded, arch, field, value):
  """Dropping llama3 scaling or the window would break the comparisons."""
  model, torch_model = loaded(arch)
  tokens = np.random.default_rng(4).integers(0, V, (B, P))
  ablated = Model(config=model.config.replace(**{field: value}),
                  params=model.params)
  logits, _ = _forward(ablated, jnp.asarray(tokens, jnp.int32),
                       ablated.init_cache(B, S))
  assert _max_diff(logits, _hf_logits(torch_model, tokens)) > 1e-2


# ---------------------------------------------------------------------------
# Configs.


def test_config_from_saved_checkpoints(loaded):
  llama = loaded("llama")[0].config
  assert llama.arch == "llama" and not llama.qkv_bias
  assert llama.rope_scaling == RopeScaling(
      factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=32)
  mistral = loaded("mistral")[0].config
  assert (mistral.sliding_window, mistral.head_dim) == (4, 24)
  assert "lm_head" in loaded("mistral")[0].params
  qwen2 = loaded("qwen2")[0].config
  assert qwen2.qkv_bias and qwen2.tie_embeddings
  assert qwen2.sliding_window is None
  assert qwen2.rope_theta == 1e6
  assert "lm_head" not in loaded("qwen2")[0].params
  gemma3 = loaded("gemma3")[0].config
  assert (gemma3.sliding_window, gemma3.sliding_window_pattern) == (4, 3)
  assert [gemma3.layer_window(i) for i in range(4)] == [4, 4, None, 4]
  assert gemma3.layer_rope(0) == (10000.0, None)
  assert gemma3.layer_rope(2) == (1e6, convert.LinearRopeScaling(2.0))
  assert (gemma3.head_dim, gemma3.query_pre_attn_scalar) == (24, 20.0)
  assert gemma3.tie_embeddings and gemma3.final_logit_softcap == 3.0
  assert "lm_head" not in loaded("gemma3")[0].params


def _legacy_config(**overrides):
  """A transformers 4 style Llama 3 config.json dict."""
  config = {
      "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 128, "rope_theta": 500000.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192},
  }
  config.update(overrides)
  return config


def test_config_from_legacy_layout_and_defaults():
  config = convert.config_from_hf(_legacy_config())
  assert config.rope_theta == 500000.0
  assert config.rope_scaling.factor == 32.0
  assert config.num_kv_heads == 4 and config.head_dim == 16  # defaults
  assert not config.tie_embeddings and config.sliding_window is None
  assert convert.config_from_hf(
      _legacy_config(rope_scaling=None)).rope_scaling is None


def test_config_rejects_unsupported_features():
  with pytest.raises(ValueError, match="'yarn'"):
    convert.config_from_hf(_legacy_config(
        rope_scaling={"type": "yarn", "factor": 4.0}))
  with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
    convert.config_from_hf(_legacy_config(architectures=["GPT2LMHeadModel"]))
  with pytest.raises(ValueError, match="attention_bias"):
    convert.config_from_hf(_legacy_config(attention_bias=True))
  with pytest.raises(ValueError, match="hidden_act"):
    convert.config_from_hf(_legacy_config(hidden_act="gelu"))
  with pytest.raises(ValueError, match="vocab_size"):
    convert.config_from_hf(_legacy_config(vocab_size=None))


def test_sliding_window_rules():
  def window(arch, **overrides):
    return convert.config_from_hf(_legacy_config(
        architectures=[arch], rope_scaling=None, **overrides)).sliding_window

  assert window("MistralForCausalLM", sliding_window=4096) == 4096
  assert window("MistralForCausalLM", sliding_window=None) is None
  assert window("LlamaForCausalLM", sliding_window=4096) is None
  assert window("Qwen2ForCausalLM", sliding_window=4096) is None
  assert window("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True,
                max_window_layers=0) == 64
  assert window("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True,
                max_window_layers=2) is None
  with pytest.raises(ValueError, match="only some layers"):
    window("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True,
           max_window_layers=1)


def test_name_mapping_round_trips():
  assert convert.hf_to_specjax("model.layers.3.self_attn.q_proj.weight") == (
      "layers_3/q", True)
  assert convert.hf_to_specjax("model.norm.weight") == ("final_norm", False)
  assert convert.hf_to_specjax("model.layers.0.self_attn.rope.x") is None
  for path in ("embed", "lm_head", "final_norm", "layers_1/k_bias",
               "layers_0/down"):
    assert convert.hf_to_specjax(convert.specjax_to_hf(path))[0] == path


# ---------------------------------------------------------------------------
# Files on disk.


def _copy_with_tensors(src: str, dst: str, edit) -> str:
  """Copies a checkpoint, rewriting model.safetensors with `edit(tensors)`."""
  shutil.copytree(src, dst)
  path = os.path.join(dst, hf.WEIGHTS_NAME)
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path)
  return dst


def _params_equal(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(x, y), a, b)))


def test_sharded_checkpoint(hf_checkpoint, loaded, tmp_path):
  _, torch_model = hf_checkpoint("mistral")
  torch_model.save_pretrained(tmp_path, max_shard_size="20KB")
  assert os.path.exists(tmp_path / hf.INDEX_NAME)
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
  model = hf.load_hf(tmp_path)
  assert model.config == loaded("mistral")[0].config
  assert _params_equal(model.params, loaded("mistral")[0].params)


def test_bfloat16_checkpoint(hf_checkpoint, tmp_path):
  _, torch_model = hf_checkpoint("llama")
  bf16 = copy.deepcopy(torch_model).to(torch.bfloat16)
  bf16.save_pretrained(tmp_path)
  with open(tmp_path / hf.WEIGHTS_NAME, "rb") as f:
    assert b'"BF16"' in f.read(4096)
  model = hf.load_hf(tmp_path)
  assert model.dtype == jnp.float32
  q = bf16.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(model.params["layers_1"]["q"], q.T)
  model16 = hf.load_hf(tmp_path, dtype=jnp.bfloat16)
  assert model16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(model16.params["embed"], np.float32),
      bf16.model.embed_tokens.weight.detach().float().numpy())


def test_tied_checkpoint_shipping_lm_head(hf_checkpoint, loaded, tmp_path):
  src, _ = hf_checkpoint("qwen2")

  def add_head(scale):
    def edit(tensors):
      tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * scale
    return edit

  same = _copy_with_tensors(src, tmp_path / "same", add_head(1.0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model = hf.load_hf(same)
  assert _params_equal(model.params, loaded("qwen2")[0].params)
  other = _copy_with_tensors(src, tmp_path / "other", add_head(2.0))
  with pytest.warns(UserWarning, match="lm_head.weight differs"):
    model = hf.load_hf(other)
  assert _params_equal(model.params, loaded("qwen2")[0].params)


def test_unknown_architecture(hf_checkpoint, tmp_path):
  src, _ = hf_checkpoint("llama")
  shutil.copytree(src, tmp_path / "ckpt")
  config_path = tmp_path / "ckpt" / "config.json"
  config = json.loads(config_path.read_text())
  config["architectures"] = ["GPT2LMHeadModel"]
  config_path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
    hf.load_hf(tmp_path / "ckpt")
  for name in convert.SUPPORTED_ARCHITECTURES:
    assert name in str(e.value)


def test_missing_tensor(hf_checkpoint, tmp_path):
  src, _ = hf_checkpoint("llama")
  name = "model.layers.1.mlp.up_proj.weight"
  path = _copy_with_tensors(src, tmp_path / "ckpt",
                            lambda tensors: tensors.pop(name))
  with pytest.raises(ValueError,
                     match=rf"missing tensor '{name}'.*'layers_1/up'"):
    hf.load_hf(path)


def test_misshapen_tensor(hf_checkpoint, tmp_path):
  src, _ = hf_checkpoint("qwen2")
  name = "model.layers.0.self_attn.k_proj.weight"

  def edit(tensors):
    tensors[name] = tensors[name][:16]  # one kv head instead of two

  path = _copy_with_tensors(src, tmp_path / "ckpt", edit)
  with pytest.raises(ValueError, match=rf"'{name}' has shape \(16, 64\), "
                     r"expected \(32, 64\)"):
    hf.load_hf(path)


def test_unexpected_tensor(hf_checkpoint, tmp_path):
  src, _ = hf_checkpoint("llama")
  name = "model.layers.0.self_attn.o_proj.bias"

  def edit(tensors):
    tensors[name] = np.zeros(64, np.float32)

  path = _copy_with_tensors(src, tmp_path / "ckpt", edit)
  with pytest.raises(ValueError, match=rf"unexpected tensor '{name}'"):
    hf.load_hf(path)


def test_missing_directory_and_files(hf_checkpoint, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf.load_hf(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf.load_hf(tmp_path)
  src, _ = hf_checkpoint("llama")
  shutil.copy(os.path.join(src, "config.json"), tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
  with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*pickle"):
    hf.load_hf(tmp_path)
  (tmp_path / hf.WEIGHTS_NAME).write_bytes(b"\xff" * 64)
  with pytest.raises(ValueError, match="not a safetensors file"):
    hf.load_hf(tmp_path)


def test_hub_unreachable(monkeypatch):
  huggingface_hub = pytest.importorskip("huggingface_hub")

  def offline(*args, **kwargs):
    raise ConnectionError("no network")

  monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
  with pytest.raises(ConnectionError,
                     match="Hub could not be reached.*local directory"):
    hf.load_hf("some-org/some-model")


# ---------------------------------------------------------------------------
# Orbax.


def test_orbax_round_trip_and_overwrite(loaded, tmp_path):
  llama, _ = loaded("llama")
  directory = tmp_path / "ckpt"
  orbax_io.save(llama, directory)
  restored = orbax_io.restore(directory)
  assert restored.config == llama.config
  assert _params_equal(restored.params, llama.params)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, V, (B, P)),
                       jnp.int32)
  want, _ = _forward(llama, tokens, llama.init_cache(B, S))
  got, _ = _forward(restored, tokens, restored.init_cache(B, S))
  np.testing.assert_array_equal(got, want)

  qwen2, _ = loaded("qwen2")
  qwen2 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), qwen2)
  orbax_io.save(qwen2, directory)  # replaces the llama checkpoint
  restored = orbax_io.restore(directory)
  assert restored.config == qwen2.config
  assert restored.dtype == jnp.bfloat16
  assert _params_equal(restored.params, qwen2.params)
  assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporaries


def test_orbax_errors(loaded, tmp_path):
  with pytest.raises(FileNotFoundError):
    orbax_io.restore(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="not a specjax checkpoint"):
    orbax_io.restore(tmp_path)
  (tmp_path / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="refusing"):
    orbax_io.save(loaded("qwen2")[0], tmp_path)
  assert (tmp_path / "notes.txt").read_text() == "keep me"
