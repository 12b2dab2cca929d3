"""Sparse upcycling (`specjax.models.upcycle`): a dense model's MLP as X
experts. References: the dense model itself (noise 0 makes every expert
its MLP, and the renormalised top-k a weighted sum of equal outputs)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models
from specjax import registry
from specjax import testing
from specjax import weights
from specjax.models import quantized
from specjax.models import upcycle

B, S = 2, 16


def _logits(model, tokens):
  out, _ = jax.jit(lambda m, t: m(t, m.init_cache(B, S)))(model, tokens)
  return np.asarray(out.logits), out.experts


@pytest.fixture(scope="module")
def dense():
  return models.init_random(testing.TINY_DRAFT, jax.random.key(3))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (B, 7)))


def test_noiseless_experts_are_the_dense_mlp(dense):
  moe = upcycle.upcycle(dense, 4, 2, noise=0.0)
  assert moe.config.num_experts == 4 and moe.config.norm_topk_prob
  layer, moe_layer = dense.params["layers_0"], moe.params["layers_0"]
  for j in range(4):
    np.testing.assert_array_equal(moe_layer["experts_gate"][j],
                                  layer["gate"].T)
    np.testing.assert_array_equal(moe_layer["experts_down"][j],
                                  layer["down"])
  want, _ = _logits(dense, TOKENS)
  got, woken = _logits(moe, TOKENS)
  np.testing.assert_allclose(got, want, atol=1e-5)
  # The seeded router still routes: 14 tokens wake more than k experts.
  assert int(woken) > 2 * dense.config.num_layers
  twin = upcycle.active_twin(moe)
  assert twin.config.intermediate_size == 2 * dense.config.intermediate_size
  np.testing.assert_allclose(_logits(twin, TOKENS)[0], want, atol=1e-5)


def test_noise_makes_seeded_distinct_experts(dense):
  a = upcycle.upcycle(dense, 4, 2, noise=0.05, seed=1)
  b = upcycle.upcycle(dense, 4, 2, noise=0.05, seed=1)
  ws = np.asarray(a.params["layers_0"]["experts_up"])
  np.testing.assert_array_equal(ws, b.params["layers_0"]["experts_up"])
  assert not np.array_equal(ws[0], ws[1])
  base = np.asarray(dense.params["layers_0"]["up"]).T
  assert (ws[0] - base).std() == pytest.approx(0.05 * base.std(),
                                                     rel=0.1)
  # Close to the dense model, not equal to it.
  want, _ = _logits(dense, TOKENS)
  got, _ = _logits(a, TOKENS)
  assert 0 < np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_bad_input_is_refused(dense):
  with pytest.raises(ValueError, match="top_k must be in"):
    upcycle.upcycle(dense, 4, 5)
  moe = upcycle.upcycle(dense, 4, 2)
  with pytest.raises(ValueError, match="already has 4 experts"):
    upcycle.upcycle(moe, 4, 2)
  with pytest.raises(ValueError, match="plan"):
    upcycle.upcycle(dense.with_plan("out_in/xla"), 4, 2)
  with pytest.raises(ValueError, match="mixture of experts"):
    upcycle.active_twin(dense)


def test_registry_builds_an_upcycled_model_once(tmp_path, monkeypatch):
  """An `UPCYCLED` name is built from its (here, fake) registry source
  once, saved as a converted directory labelled upcycled, then read."""
  from tests.test_gguf import _fake_source  # pylint: disable=g-import-not-at-top
  from tests.test_gguf import write_gguf  # pylint: disable=g-import-not-at-top
  path = tmp_path / "tiny.gguf"
  write_gguf(path, arch="qwen2")
  source = _fake_source(tmp_path, path.read_bytes(), name="tiny-fake")
  monkeypatch.setitem(weights.SOURCES, source.name, source)
  how = registry.Upcycling(source.name, experts=4, top_k=2)
  monkeypatch.setitem(registry.UPCYCLED, "tiny-x4k2", how)
  monkeypatch.setitem(registry.UPCYCLED, "tiny-x4k2-twin",
                      dataclasses.replace(how, twin=True))
  cache = tmp_path / "cache"
  load = functools.partial(registry.load_pretrained, dtype=jnp.float32,
                           cache_dir=cache, progress=False, matmul=None)
  dense, tok = load(source.name)
  want = upcycle.upcycle(dense, 4, 2)
  got, got_tok = load("tiny-x4k2")
  assert got.config == want.config
  assert jax.tree.all(jax.tree.map(np.array_equal, got.params, want.params))
  directory = registry.converted_dir("tiny-x4k2", jnp.float32, cache,
                                     "upcycled")
  assert "UPCYCLED" in (directory / registry.SOURCE_FILE).read_text()
  assert got_tok.encode("hello") == tok.encode("hello")
  assert registry.load_tokenizer("tiny-x4k2", cache).encode(
      "hello") == tok.encode("hello")
  with monkeypatch.context() as m:
    m.setattr(upcycle, "upcycle", None)  # built already: only read
    again, _ = load("tiny-x4k2")
  assert jax.tree.all(jax.tree.map(np.array_equal, again.params, got.params))
  twin, _ = load("tiny-x4k2-twin")
  assert twin.config.intermediate_size == 2 * dense.config.intermediate_size
  assert not twin.config.num_experts
  # Experts int8 as they are made: the float model's experts (the same
  # seeded noise), each quantized as its [out, in] matrix, and saved.
  monkeypatch.setitem(registry.UPCYCLED, "tiny-x4k2-int8",
                      dataclasses.replace(how, quantize="int8"))
  packed, _ = load("tiny-x4k2-int8")
  assert packed.quantization == "int8"
  for name in ("experts_gate", "experts_down"):
    stack = packed.params["layers_1"][name]
    floats = np.asarray(got.params["layers_1"][name])  # [X, F, E]
    for j in range(4):
      rows_first = floats[j].T if name == "experts_down" else floats[j]
      want_j = quantized.quantize_array(rows_first, quantized.QuantSpec(),
                                        name)
      np.testing.assert_array_equal(quantized.select(stack, j).low,
                                    want_j.low)
      np.testing.assert_array_equal(quantized.select(stack, j).scales,
                                    want_j.scales)
  with pytest.raises(ValueError, match="quantized"):
    upcycle.active_twin(packed)
