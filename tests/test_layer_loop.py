"""The layer loop: a kernel plan runs a float32 model's layers as one
`lax.scan` whose products read each layer's matrix in place
(`kernels.smallm_pick`, `matmul.LayerPick`).

Shape letters: X rows, I input features, O output features, L layers.

The kernel is checked against numpy in float64. The loop is checked against
the same model unrolled (`MatmulPlan.layer_loop=False`), which computes
each product in the same kernel, over every seam of the forward: layer
ranges, a residual stream entering mid-model, hidden layers, deferred cache
writes, prefill and a sliding window. Against transformers, the loop is
what `test_hf_checkpoints` runs for its kernel plans, and greedy
speculation with a looped pair equals `generate` in `test_kernels`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu
from specjax.cpu import kernels
from specjax.models import init_random
from specjax.models import tiny

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="no C++ compiler or not CPU")

LOOP = cpu.plan("out_in/kernel")
UNROLLED = dataclasses.replace(LOOP, layer_loop=False)


@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_pick_matches_float64(rows):
  rng = np.random.default_rng(rows)
  ws = tuple(rng.standard_normal((37, 48)).astype(np.float32)
             for _ in range(3))
  x = rng.standard_normal((rows, 48)).astype(np.float32)
  pick = jax.jit(kernels.smallm_pick)
  for i, w in enumerate(ws):
    got = np.asarray(pick(x, jnp.int32(i), ws))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * 48)


def test_pick_rejects_bad_input():
  x = jnp.ones((2, 8), jnp.float32)
  ws = (jnp.ones((4, 8)), jnp.ones((4, 8)))
  with pytest.raises(ValueError, match="one shape"):
    kernels.smallm_pick(x, jnp.int32(0), (ws[0], jnp.ones((5, 8))))
  with pytest.raises(ValueError, match=r"\[O, 8\] float32"):
    kernels.smallm_pick(x, jnp.int32(0), (jnp.ones((4, 7)),) * 2)
  with pytest.raises(ValueError, match="scalar index"):
    kernels.smallm_pick(x, jnp.zeros((1,), jnp.int32), ws)


def _model(config, plan):
  model = init_random(config, jax.random.key(0)).with_plan(plan)
  # A bias that is not zero, so picking the wrong layer's row shows.
  params = jax.tree.map(lambda w: w + 0.01 * jnp.arange(w.size).reshape(
      w.shape) / w.size if w.ndim == 1 else w, model.params)
  return model.replace(params=params)


def _ops(model, tokens, cache, **kw):
  hlo = jax.jit(lambda m, t, c: m.forward(t, c, **kw).hidden).lower(
      model, tokens, cache).as_text()
  return hlo.count("specjax_smallm_pick")


def test_loop_holds_one_layer_and_equals_unrolled():
  # Four layers with q/k/v biases and a sliding window on every layer.
  config = tiny.TINY_TARGET.replace(num_layers=4, qkv_bias=True,
                                    sliding_window=3)
  loop, unrolled = _model(config, LOOP), _model(config, UNROLLED)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, 128, (2, 9)), jnp.int32)
  chunk = jnp.asarray(rng.integers(0, 128, (2, 3)), jnp.int32)
  # One copy of the layer's seven products, whatever L.
  assert _ops(loop, chunk, loop.init_cache(2, 16)) == 7
  assert _ops(unrolled, chunk, unrolled.init_cache(2, 16)) == 0

  @jax.jit
  def run(model):
    cache = model.init_cache(2, 16)
    first = model.forward(prompt, cache, cache_is_empty=True)
    lower = model.forward(chunk, first.cache, layers=(0, 3),
                          hidden_layers=(1,))
    upper = model.forward(None, first.cache, layers=(1, 4),
                          residual=lower.layer_hidden[0], write_cache=False)
    return first, lower, upper

  for got, want in zip(run(loop), run(unrolled)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  first, lower, upper = run(loop)
  assert upper.keys.shape == (3, 2, 3, 2, 16)  # layers 1..3
  # Layers outside the range keep the prefill's cache.
  np.testing.assert_array_equal(lower.cache.k[3], first.cache.k[3])


def test_loop_left_to_models_it_cannot_take():
  tokens = jnp.ones((1, 2), jnp.int32)
  gemma = _model(tiny.TINY_GEMMA3_TARGET, LOOP)  # local and global layers
  assert _ops(gemma, tokens, gemma.init_cache(1, 8)) == 0
  one = _model(tiny.TINY_DRAFT, LOOP)  # a single layer
  assert _ops(one, tokens, one.init_cache(1, 8)) == 0
  bf16 = _model(tiny.TINY_TARGET, LOOP)
  bf16 = bf16.replace(params=jax.tree.map(
      lambda w: w.astype(jnp.bfloat16), bf16.params))
  assert _ops(bf16, tokens, bf16.init_cache(1, 8)) == 0


def test_quantized_loop_takes_each_layers_format():
  # Layer 0 in int8 (per channel), layer 1 in int4 with mins, so the loop's
  # kernel must read each layer's own format (as a GGUF file's Q4_K and
  # Q6_K layers need).
  float_model = _model(tiny.TINY_TARGET, LOOP)
  params = dict(float_model.quantize("int4").params)
  params["layers_0"] = float_model.quantize("int8").params["layers_0"]
  loop = float_model.replace(params=params)
  unrolled = loop.with_plan(UNROLLED)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 5)),
                       jnp.int32)
  cache = loop.init_cache(2, 8)
  hlo = jax.jit(lambda m, t, c: m.forward(t, c).hidden).lower(
      loop, tokens, cache).as_text()
  assert hlo.count("specjax_smallm_quant_pick") == 7
  fwd = jax.jit(lambda m: m.forward(tokens, cache, cache_is_empty=True))
  got, want = fwd(loop), fwd(unrolled)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
