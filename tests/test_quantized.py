"""Quantized matrices: exact GGUF blocks and int8/int4 of float weights.

Shape letters: O rows (output features), I row length, E hidden, V vocab.

GGUF blocks are random bytes with finite float16 scale fields, so every
code, sub-block scale and min a format can hold occurs; the reference is
`gguf.quants.dequantize`, the fp32 loader's own dequantisation.
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models
from specjax.checkpoints import gguf as gguf_lib
from specjax.checkpoints import gguf_blocks
from specjax.models import quantized
from specjax.models import tiny
from specjax.models.matmul import MatmulPlan
from specjax.models.matmul import project
from specjax.testing import random_blocks
import test_gguf

Q = gguf.GGMLQuantizationType


def _device(w):
  return jax.tree.map(jnp.asarray, w)


@pytest.mark.parametrize("qtype", gguf_blocks.SUPPORTED,
                         ids=lambda q: q.name)
def test_blocks_dequantise_bit_for_bit(qtype):
  block, _ = gguf.GGML_QUANT_SIZES[qtype]
  data = random_blocks(qtype, rows=6, blocks=3)
  want = gguf.quants.dequantize(data, qtype)  # [O, I] float32
  w = gguf_blocks.from_blocks(data, qtype, "t", (6, 3 * block))
  got = np.asarray(jax.jit(quantized.dequantize)(_device(w)))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  # The embedding lookup gathers packed rows, then dequantises them.
  ids = jnp.array([[5, 0], [2, 2]])
  rows = np.asarray(jax.jit(quantized.take)(_device(w), ids))
  np.testing.assert_array_equal(rows, want[np.asarray(ids)])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0], ids=lambda q: q.name)
def test_blocks_of_gguf_quantizer(qtype):
  """Blocks written by the gguf package's own quantizer (not random)."""
  w = np.random.default_rng(1).normal(0, 1, (4, 64)).astype(np.float32)
  data = gguf.quants.quantize(w, qtype)
  got = quantized.dequantize(_device(
      gguf_blocks.from_blocks(data, qtype, "t", (4, 64))))
  np.testing.assert_array_equal(np.asarray(got),
                                gguf.quants.dequantize(data, qtype))


def test_repacked_bytes_stay_near_the_file():
  """Q8_0, Q5_0 and Q6_K keep their size; Q4_K (its 6-bit sub-block
  scales and mins a byte each) 148 bytes for the file's 144."""
  for qtype, most in [(Q.Q8_0, 1.0), (Q.Q5_0, 1.0), (Q.Q4_K, 148 / 144),
                      (Q.Q6_K, 1.0)]:
    data = random_blocks(qtype, 4, 2)
    w = gguf_blocks.from_blocks(data, qtype, "t", (4, 1))
    assert w.nbytes <= most * data.nbytes + 1e-9, qtype.name


def test_unsupported_block_type_names_the_tensor():
  data = np.zeros((2, 20), np.uint8)  # one Q4_1 block per row
  with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight'.*Q4_1"):
    gguf_blocks.from_blocks(data, Q.Q4_1, "blk.0.ffn_up.weight", (2, 32))


def _int8_round_trip_error(w):
  q = quantized.quantize_array(w, quantized.QuantSpec(bits=8), "t")
  return np.abs(np.asarray(quantized.dequantize(_device(q))) - w)


@pytest.mark.parametrize("name,bound", [
    ("int8", 0.5 / 127), ("int4", 0.5 / 15), ("int4:g16:sym", 0.5 / 7)])
def test_int_quantization_error_is_half_a_step(name, bound):
  """Each value is within half a quantization step of the original (the
  step relative to the channel's or group's range)."""
  w = np.random.default_rng(2).normal(0, 1, (8, 64)).astype(np.float32)
  spec = quantized.QuantSpec.parse(name)
  q = quantized.quantize_array(w, spec, "t")
  err = np.abs(np.asarray(quantized.dequantize(_device(q))) - w)
  group = 64 if spec.bits == 8 else spec.group
  span = w.reshape(8, -1, group)
  span = (np.abs(span).max(-1) * 2 if spec.bits == 8 or spec.symmetric
          else span.max(-1) - span.min(-1))  # [O, N]
  assert err.max() > 0
  assert np.all(err.reshape(8, -1, group) <= bound * span[..., None] * 1.0001)


def test_activation_quantization_by_chunks():
  """Each row's chunks of 64 inputs: scale max|x| / 127, codes rounded
  half to even (numpy's rule), an all-zero chunk all zero."""
  rng = np.random.default_rng(3)
  x = rng.normal(0, 2, (3, 192)).astype(np.float32)
  x[1, 64:128] = 0.0
  x[2, 5] = 40.0  # an outlier widens only its own chunk's step
  got = np.asarray(quantized.quantize_activations(jnp.asarray(x)))
  for r in range(3):
    for c in range(3):
      chunk = x[r, 64 * c:64 * (c + 1)]
      d = np.float32(np.abs(chunk).max()) / np.float32(127)
      want = (np.zeros_like(chunk) if d == 0 else
              np.round(chunk / d).astype(np.float32) * d)
      np.testing.assert_array_equal(got[r, 64 * c:64 * (c + 1)], want)
  assert np.abs(got - x).max() <= 40.0 / 127 / 2 * (1 + 1e-6)
  with pytest.raises(ValueError, match="chunks of 64"):
    quantized.quantize_activations(jnp.ones((2, 96)))


def test_group_size_must_divide_the_input_dimension():
  w = np.zeros((4, 96), np.float32)
  with pytest.raises(ValueError, match=r"'layers_0/up'.*64 does not divide"):
    quantized.quantize_array(w, quantized.QuantSpec(bits=4, group=64),
                             "layers_0/up")
  with pytest.raises(ValueError, match="Unknown weight quantization"):
    quantized.QuantSpec.parse("int3")
  with pytest.raises(ValueError, match="Unknown quantize"):
    quantized.parse("fp8")


def _assert_rounding_close(got, want):
  """Equal to float32 accumulation-order rounding: the same products summed
  in another order differ by a few ulps per sum of 64-512 terms, grown
  through the layers; 1e-5 of the logits' scale (~80 ulps) allows that and
  nothing more (a quantization step moves int4 logits by ~1e-2)."""
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=1e-5 * max(1.0, np.abs(want).max()))


def _logits(model, tokens):
  out = jax.jit(lambda m, t: m(t, m.init_cache(t.shape[0], 16))[0].logits)(
      model, tokens)
  return np.asarray(out)


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:g16:sym"])
@pytest.mark.parametrize("plan", ["in_out/xla", "out_in/xla"])
def test_quantized_model_logits_equal_the_dequantised_model(spec, plan):
  """Same weights, same float32 products; only the dot's accumulation
  order may differ (the quantized path contracts an [O, I] temporary)."""
  target, _ = tiny.tiny_pair()
  target = target.with_plan(plan)
  q = target.quantize(spec)
  assert q.quantization == spec.split(":")[0]
  assert q.weight_bytes_per_token < target.weight_bytes_per_token / 3
  tokens = jnp.array([[3, 17, 99, 4, 5], [1, 2, 3, 4, 0]])
  want = _logits(q.dequantized(), tokens)
  got = _logits(q, tokens)
  _assert_rounding_close(got, want)
  assert np.abs(want - _logits(target, tokens)).max() > 1e-4


def test_tied_head_and_embedding_from_gguf_blocks():
  """A model whose every matrix (and tied embedding) holds K-quant
  blocks: its logits equal the dequantised fp32 model's."""
  config = models.ModelConfig(
      arch="qwen2", vocab_size=48, hidden_size=256, intermediate_size=512,
      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=128,
      qkv_bias=True, tie_embeddings=True)
  base = models.init_random(config, jax.random.key(0))
  flat = models.config.flatten(base.params)
  types = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0]
  for n, path in enumerate(["embed", *models.matrix_paths(config)]):
    shape = flat[path].shape
    rows, cols = shape if path == "embed" else shape[::-1]
    qtype = types[n % len(types)]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, rows, cols // block, seed=n)
    flat[path] = _device(gguf_blocks.from_blocks(data, qtype, path, shape))
  model = base.replace(params=models.config.unflatten(
      config, lambda p, _: flat[p]))
  models.check_params(config, model.params)
  assert model.quantization == "q4_k+q5_0+q6_k+q8_0"
  tokens = jnp.array([[3, 17, 40, 4]])
  _assert_rounding_close(_logits(model, tokens),
                         _logits(model.dequantized(), tokens))


def test_packed_weights_are_the_parameters_of_the_compiled_product():
  """The jitted product takes the packed arrays: no float32 [O, I]
  parameter or constant, and the unpacking is fused (XLA CPU then feeds
  an [O, I] float32 temporary to its dot; see `quantized`'s docstring)."""
  w = np.random.default_rng(3).normal(0, 1, (96, 64)).astype(np.float32)
  q = _device(quantized.quantize_array(w, quantized.QuantSpec(bits=4), "t"))
  x = jnp.ones((2, 64), jnp.float32)
  fn = jax.jit(lambda x, q: project(x, q, MatmulPlan()))
  hlo = fn.lower(x, q).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  params = [line for line in entry.splitlines() if "parameter(" in line]
  assert any("u8[96,32]" in line for line in params), params
  assert not any("f32[96,64]" in line for line in params), params
  assert "constant" not in "".join(
      line for line in hlo.splitlines() if "f32[96,64]" in line
      and "fusion" not in line and "dot" not in line)
  assert "fusion" in entry


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_gguf_keeps_blocks_equal_to_the_fp32_loader(tmp_path, arch,
                                                         monkeypatch):
  """quantize="gguf" on a file of Q8_0, Q5_0, Q4_K and Q6_K matrices (and
  F32 norms): every parameter dequantises to the fp32 loader's value bit
  for bit, llama's Q/K row permutation undone on the packed rows."""
  # Rows of 256 so the K-quants fit: E = F = 256.
  monkeypatch.setattr(test_gguf, "E", 256)
  monkeypatch.setattr(test_gguf, "F", 256)
  monkeypatch.setattr(test_gguf, "H", 4)
  monkeypatch.setattr(test_gguf, "K", 2)
  monkeypatch.setattr(test_gguf, "D", 64)
  types = {"q_proj": Q.Q4_K, "k_proj": Q.Q6_K, "v_proj": Q.Q8_0,
           "o_proj": Q.Q5_0, "mlp": Q.Q8_0, "embed": Q.Q5_0,
           "lm_head": Q.Q8_0}
  weights = test_gguf.hf_weights(arch)
  # gguf-py cannot quantize K-quants: write random blocks for them.
  raw = {}
  for i in range(test_gguf.L):
    for part, qtype, rows in [("q", Q.Q4_K, 256), ("k", Q.Q6_K, 128)]:
      name = f"model.layers.{i}.self_attn.{part}_proj.weight"
      del weights[name]
      raw[f"blk.{i}.attn_{part}.weight"] = (
          None, qtype, random_blocks(qtype, rows, 1, seed=i))
  path = tmp_path / "model.gguf"
  test_gguf.write_gguf(path, arch, types=types, tensors=weights, raw=raw)
  dense = gguf_lib.load_gguf(path, progress=False)
  kept = gguf_lib.load_gguf(path, progress=False, quantize="gguf")
  assert kept.quantization == "q4_k+q5_0+q6_k+q8_0"
  want = models.config.flatten(dense.params)
  for p, w in models.config.flatten(kept.dequantized().params).items():
    np.testing.assert_array_equal(np.asarray(w).view(np.uint32),
                                  np.asarray(want[p]).view(np.uint32),
                                  err_msg=p)
  tokens = jnp.array([[3, 17, 30, 4]])
  _assert_rounding_close(_logits(kept, tokens), _logits(dense, tokens))
  int8 = gguf_lib.load_gguf(path, progress=False, quantize="int8")
  assert int8.quantization == "int8"
