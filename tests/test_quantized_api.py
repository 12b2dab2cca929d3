"""`quantize=` on every loader, the memory plan and the experiment config.

Shape letters: V vocab. Models are the tiny random ones and the tiny GGUF
files of `test_gguf` (Q8_0 matrices, F32 norms).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_pair as tiny_config
from experiments import pair as pair_lib
from experiments import validation
from specjax import registry
from specjax.checkpoints import gguf as gguf_lib
from specjax.checkpoints import hf
from specjax.checkpoints import native
from specjax.cpu import kernels
from specjax.models import quantized
from specjax.models import tiny
from specjax.sharding import memory
import test_gguf

Q = test_gguf.Q
_Q8 = {"proj": Q.Q8_0, "mlp": Q.Q8_0, "embed": Q.Q8_0, "lm_head": Q.Q8_0}


def _logits(model, tokens):
  fn = jax.jit(lambda m, t: m(t, m.init_cache(t.shape[0], 8))[0].logits)
  return np.asarray(fn(model, tokens))


def test_native_load_quantizes_as_model_quantize(tmp_path):
  target, _ = tiny.tiny_pair()
  native.save(target, tmp_path / "m.safetensors")
  loaded = native.load(tmp_path / "m.safetensors", quantize="int4:g16")
  assert loaded.quantization == "int4"
  tokens = jnp.array([[1, 2, 3]])
  np.testing.assert_array_equal(_logits(loaded, tokens),
                                _logits(target.quantize("int4:g16"), tokens))
  # A quantized model saves its packed arrays and loads as itself.
  native.save(loaded, tmp_path / "q.safetensors")
  again = native.load(tmp_path / "q.safetensors")
  assert again.quantization == "int4"
  np.testing.assert_array_equal(_logits(again, tokens),
                                _logits(loaded, tokens))


def test_float_checkpoints_reject_gguf_blocks(tmp_path):
  with pytest.raises(ValueError, match=r"m\.safetensors.*float checkpoint"):
    native.load(tmp_path / "m.safetensors", quantize="gguf")
  with pytest.raises(ValueError, match="float checkpoint"):
    hf.load_hf(tmp_path, quantize="gguf")
  with pytest.raises(ValueError, match="not a GGUF file"):
    registry.load_pretrained(tmp_path, quantize="gguf")
  with pytest.raises(ValueError, match="Unknown quantize"):
    registry.load_pretrained(tmp_path, quantize="q4")


def test_quantize_refuses_a_mesh(tmp_path):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  with pytest.raises(ValueError, match="not sharded"):
    registry.load_pretrained(tmp_path / "x.gguf", quantize="int8", mesh=mesh)
  with pytest.raises(ValueError, match="not sharded"):
    hf.load_hf(tmp_path, quantize="int8", mesh=mesh)


def test_load_pretrained_gguf_file_each_way(tmp_path):
  path = tmp_path / "tiny.gguf"
  test_gguf.write_gguf(path, "qwen2", types=_Q8)
  dense, _ = registry.load_pretrained(path, matmul=None, progress=False)
  kept, tokenizer = registry.load_pretrained(path, quantize="gguf",
                                             progress=False)
  assert tokenizer.vocab_size >= dense.vocab_size
  assert kept.quantization == "q8_0"
  assert kept.plan.name == ("out_in/kernel" if kernels.available()
                            else "in_out/xla")
  int4, _ = registry.load_pretrained(path, quantize="int4", progress=False)
  assert int4.quantization == "int4"
  # The file's own Q8_0 blocks: 34 bytes per 32 weights, under 1.5x.
  file_bytes = sum(t.data.nbytes for t in
                   gguf_lib.GGUFFile(path).tensors)
  assert kept.weight_bytes_per_token <= 1.5 * file_bytes
  assert dense.weight_bytes_per_token > 3 * kept.weight_bytes_per_token
  tokens = jnp.array([[5, 9, 2]])
  want = _logits(dense, tokens)
  np.testing.assert_allclose(_logits(kept, tokens), want, rtol=0,
                             atol=1e-5 * max(1.0, np.abs(want).max()))


def test_int8_activations_api(tmp_path):
  """":a8" on `quantize` (load_pretrained, Model.quantize, the experiment
  config) and `Model.with_activations`; checkpoint loaders refuse it, and
  a matrix whose inputs are not chunks of 64 is named."""
  bits = lambda m: {w.act_bits for w in jax.tree.leaves(
      m.params, is_leaf=quantized.is_quantized) if quantized.is_quantized(w)}
  target, draft = tiny.tiny_pair()
  a8, int4 = target.quantize("int4:a8"), target.quantize("int4")
  assert (bits(int4), bits(a8), a8.quantization) == ({0}, {8}, "int4")
  assert (target.int8_activations, int4.int8_activations,
          a8.int8_activations) == (False, False, True)
  tokens = jnp.array([[5, 9, 2]])
  want, got = _logits(int4, tokens), _logits(a8, tokens)
  assert 0 < np.abs(got - want).max() < 3e-2 * np.abs(want).max()
  np.testing.assert_allclose(_logits(a8.with_activations(0), tokens), want,
                             rtol=0, atol=1e-5 * np.abs(want).max())
  with pytest.raises(ValueError, match="quantize its weights first"):
    target.with_activations(8)
  with pytest.raises(ValueError,
                     match=r"matrix \['embed'\] \[128, 32\].*chunks of 64"):
    draft.quantize("int8:a8")  # hidden size 32
  path = tmp_path / "tiny.gguf"
  test_gguf.write_gguf(path, "qwen2", types=_Q8)
  with pytest.raises(ValueError, match="Model.with_activations"):
    gguf_lib.load_gguf(path, quantize="gguf:a8")
  with pytest.raises(ValueError, match="not chunks of 64"):
    registry.load_pretrained(path, quantize="gguf:a8", progress=False)
  config = tiny_config.get_config()
  config.quantize = "int4:a8"
  validation.validate_config(config)
  assert bits(pair_lib.load_pair(config).target) == {8}


def test_memory_plan_counts_packed_bytes():
  target, draft = tiny.tiny_pair()
  q = target.quantize("int8")
  plan = memory.plan({"target": q, "draft": draft}, batch=1, cache_size=16,
                     limit=None)
  packed = sum(x.nbytes for x in jax.tree.leaves(q.params))
  assert plan.bytes("target", "weights") == packed
  full = memory.plan({"target": target}, batch=1, cache_size=16, limit=None)
  assert full.bytes("target", "weights") > 3.5 * packed


def test_experiment_config_quantizes_draft_and_target_independently():
  config = tiny_config.get_config()
  dense = pair_lib.model_info("target", pair_lib.load_pair(config).target)
  config.quantize = "int4"
  validation.validate_config(config)
  pair = pair_lib.load_pair(config)
  assert pair.target.quantization == "int4"
  assert pair.draft.quantization is None
  info = pair_lib.model_info("target", pair.target)
  assert info["quantization"] == "int4"
  assert info["num_params"] == dense["num_params"]
  assert info["weight_bytes_per_token"] < dense["weight_bytes_per_token"] / 4
  config.quantize, config.draft_quantize = "", "int8"
  pair = pair_lib.load_pair(config)
  assert (pair.target.quantization, pair.draft.quantization) == (None,
                                                                 "int8")
  config.draft_quantize = "int5"
  with pytest.raises(validation.ConfigError, match="draft_quantize"):
    validation.validate_config(config)


def test_same_draft_with_draft_quantize_is_the_targets_quantized_copy():
  """`draft=same` + `draft_quantize`: the target's own weights, quantized,
  draft for the float target; the target keeps its float weights and the
  greedy run stays exact (QSpec-style self-speculation)."""
  from specjax import decode  # pylint: disable=g-import-not-at-top
  config = tiny_config.get_config()
  config.draft, config.draft_quantize = "same", "int4"
  validation.validate_config(config)
  pair = pair_lib.load_pair(config)
  assert (pair.target.quantization, pair.draft.quantization) == (None,
                                                                 "int4")
  assert pair.draft.config == pair.target.config
  prompts = [[3, 9, 27, 81], [5, 25]]
  ref = decode.generate(pair.target, prompts, max_new_tokens=10)
  out = decode.speculative_generate(pair.target, pair.draft, prompts,
                                    gamma=3, max_new_tokens=10)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  # Its own weights at 4 bits predict most of the target's tokens.
  assert out.stats.accepted_by_position.sum() > (
      0.5 * out.stats.proposed_by_position.sum())
  config.draft_quantize = "gguf"  # the tiny target has no GGUF file
  with pytest.raises(validation.ConfigError, match="GGUF target"):
    pair_lib.load_pair(config)
