"""The accelerator layout: layers stacked [L, ...] and run as one scan.

The scanned model must compute what the per-layer model computes (which
tests/test_hf_checkpoints.py checks against transformers), for every
seam: prefill, cached decoding, layer ranges, hidden layers, Gemma 3's
local/global groups, checkpoints and sharding specs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from specjax import decode
from specjax import testing
from specjax.checkpoints import native
from specjax.models import MatmulPlan
from specjax.models import init_random
from specjax.models import LayerSubset
from specjax.models import stacking
from specjax.sharding import rules

SCAN = MatmulPlan(scan_layers=True)
CONFIGS = {
    "llama": dataclasses.replace(testing.TINY_TARGET, num_layers=5),
    # 8 layers of period 6 (or less): unrolled head, scanned groups, tail.
    "gemma3": dataclasses.replace(testing.TINY_GEMMA3_TARGET, num_layers=8),
}


def _outputs(model, tokens, lengths):
  cache = model.init_cache(2, 32)
  first, cache = model.prefill(tokens, lengths, cache)
  out, after = model(tokens[:, :3], cache)
  L = model.config.num_layers
  ranged, _ = model(None, cache, layers=(1, L - 1), hidden_layers=(2, L - 2),
                    residual=jnp.ones((2, 3, model.config.hidden_size)))
  return [first, out.logits, after.k, after.v, ranged.logits,
          *ranged.layer_hidden]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_scanned_equals_per_layer(arch):
  config = CONFIGS[arch]
  model = init_random(config, jax.random.key(0))
  scanned = model.with_plan(SCAN)
  assert stacking.is_stacked(scanned.params)
  assert not stacking.is_stacked(model.params)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, config.vocab_size, (2, 7)), jnp.int32)
  lengths = jnp.array([7, 5], jnp.int32)
  for want, got in zip(_outputs(model, tokens, lengths),
                       _outputs(scanned, tokens, lengths)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               rtol=1e-5, atol=1e-5)


def test_scan_runs_one_layer_body():
  """The scanned forward holds one layer's code per group, not L."""
  config = dataclasses.replace(testing.TINY_TARGET, num_layers=6)
  model = init_random(config, jax.random.key(0))
  tokens = jnp.ones((1, 4), jnp.int32)

  def dots(m):
    text = jax.jit(lambda m: m(tokens, m.init_cache(1, 8))[0].logits
                   ).lower(m).as_text()
    return text.count("dot_general"), text.count("stablehlo.while")
  per_layer, scanned = dots(model), dots(model.with_plan(SCAN))
  assert scanned[1] == 1 and per_layer[1] == 0
  assert scanned[0] * 3 <= per_layer[0]


def test_greedy_speculation_on_scanned_pair_equals_generate():
  target, draft = testing.tiny_pair()
  target, draft = target.with_plan(SCAN), draft.with_plan(SCAN)
  prompts = [[3, 17, 5, 9], [4, 4, 8, 1, 2, 30]]
  want = decode.generate(target, prompts, max_new_tokens=12)
  base = decode.generate(testing.tiny_pair()[0], prompts, max_new_tokens=12)
  got = decode.speculative_generate(target, draft, prompts, gamma=3,
                                    max_new_tokens=12)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(want.tokens, base.tokens)


def test_plan_names_and_round_trip(tmp_path):
  assert MatmulPlan.parse("in_out/xla/scan") == SCAN
  assert SCAN.name == "in_out/xla/scan"
  assert MatmulPlan.parse("out_in/xla/scan").transposed
  with pytest.raises(ValueError, match="scan_layers"):
    MatmulPlan(layout="out_in", kernel=True, scan_layers=True)
  assert MatmulPlan.for_backend("tpu") == SCAN
  assert MatmulPlan.for_backend("cpu") == MatmulPlan()
  model = init_random(testing.TINY_TARGET, jax.random.key(1))
  back = model.with_plan("out_in/xla/scan").with_plan(MatmulPlan())
  assert jax.tree.all(jax.tree.map(
      lambda a, b: bool(jnp.array_equal(a, b)), back.params, model.params))
  native.save(model.with_plan(SCAN), tmp_path / "m")
  loaded = native.load(tmp_path / "m")
  assert jax.tree.all(jax.tree.map(
      lambda a, b: bool(jnp.array_equal(a, b)), loaded.params, model.params))


def test_layers_of_different_formats_do_not_stack():
  model = init_random(testing.TINY_TARGET, jax.random.key(1))
  params = dict(model.params)
  params["layers_0"] = dict(params["layers_0"],
                            q=params["layers_0"]["q"][:, :8])
  with pytest.raises(ValueError):
    stacking.stack_layers(params, model.config.num_layers)
  mixed = model.quantize("int8").canonical_params()
  mixed["layers_1"] = model.params["layers_1"]
  with pytest.raises(ValueError, match="differs in structure"):
    stacking.stack_layers(mixed, model.config.num_layers)


def test_stacked_partition_specs_keep_the_layer_axis_whole():
  mesh = jax.make_mesh((1, 1), ("data", "model"),
                       devices=jax.devices()[:1])
  config = testing.SHARDABLE_TARGET
  flat = rules.param_specs(config, mesh)
  stacked = rules.param_specs(config, mesh, plan=SCAN)
  for name, spec in stacked[stacking.KEY].items():
    assert spec == PartitionSpec(None, *flat["layers_0"][name])


def test_quantized_and_subset_models_scan_as_they_run_per_layer():
  model = init_random(CONFIGS["llama"], jax.random.key(2))
  tokens = jnp.asarray([[5, 9, 2, 7]], jnp.int32)
  for per_layer in (model.quantize("int8"),
                    LayerSubset.create(model, exit_layer=4, skip=(1,))):
    if isinstance(per_layer, LayerSubset):
      scanned = LayerSubset.create(model.with_plan(SCAN), exit_layer=4,
                                   skip=(1,))
    else:
      scanned = model.with_plan(SCAN).quantize("int8")
      assert stacking.is_stacked(scanned.params)
    want, _ = per_layer(tokens, per_layer.init_cache(1, 8))
    got, _ = scanned(tokens, scanned.init_cache(1, 8))
    np.testing.assert_allclose(np.asarray(got.logits),
                               np.asarray(want.logits), rtol=1e-5,
                               atol=1e-5)
