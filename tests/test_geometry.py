"""The forward takes its geometry from the caller: positions, masks, layer
ranges, hidden states, and cache compaction.

The reference is a NumPy Llama forward written here from the parameters
alone (embedding, RMSNorm, rotary halves, grouped-query attention under an
arbitrary mask, SwiGLU), sharing no code with `specjax.models`; for Gemma 3
it adds the scaled embedding, (1 + w) norms, QK-norm, post-norms, GeGLU,
local and global layers with their own window and rope, the query scalar
and the logit soft-cap.
"""

import math


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models
from specjax import testing

_CONFIGS = {
    "llama": testing.TINY_TARGET,
    "qwen2": testing.TINY_TARGET.replace(arch="qwen2", qkv_bias=True),
    "mistral_window": testing.TINY_TARGET.replace(arch="mistral",
                                                  sliding_window=3),
    # Two layers (local, global) so that layer ranges split it in two.
    "gemma3": testing.TINY_GEMMA3_TARGET.replace(
        num_layers=2, sliding_window=3, sliding_window_pattern=2),
}
PREFIX = 5
# A token tree after the prefix: node 0 at depth 0, nodes 1 and 2 its two
# children, node 3 a child of node 2. Parents, depths, and the
# ancestor-or-self mask [T, T].
PARENTS = [-1, 0, 0, 2]
DEPTHS = np.array([0, 1, 1, 2])
TREE_MASK = np.array([[1, 0, 0, 0],
                      [1, 1, 0, 0],
                      [1, 0, 1, 0],
                      [1, 0, 1, 1]], bool)


@pytest.fixture(params=sorted(_CONFIGS))
def model(request):
  m = models.init_random(_CONFIGS[request.param], jax.random.key(11))
  # Non-zero biases, and Gemma's (1 + w) norm scales away from w = 0, so
  # they matter.
  rng = np.random.default_rng(12)

  def perturb(path, x):
    name = jax.tree_util.keystr(path)
    if "bias" in name:
      return x + 0.1
    if "norm" in name and m.config.norm_plus_one:
      return x + 0.3 * rng.standard_normal(x.shape).astype(np.float32)
    return x

  return testing.Jitted(m.replace(params=jax.tree.map_with_path(
      perturb, m.params)))


def _rms(x, scale, eps, plus_one=False):
  scale = 1 + scale if plus_one else scale
  return scale * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _rope(x, positions, theta):
  """x [T, N, D] at positions [T], rotating halves."""
  d = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
  ang = positions[:, None, None] * inv  # [T, 1, D/2]
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                         x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _reference_logits(model, tokens, positions, mask):
  """One sequence: tokens [T], positions [T], mask [T, T] (query, key) ->
  logits [T, V], with the sliding window applied on positions."""
  c = model.config
  assert c.rope_scaling is None and model.plan.layout == "in_out"
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), model.params)
  causal = np.array(mask, bool)
  gemma = c.arch == "gemma3"
  x = p["embed"][tokens] * (np.sqrt(c.hidden_size) if gemma else 1)
  h_q, h_kv, d = c.num_heads, c.num_kv_heads, c.head_dim

  def rms(x, scale):
    return _rms(x, scale, c.rms_norm_eps, plus_one=gemma)

  for i in range(c.num_layers):
    lp = p[f"layers_{i}"]
    # Gemma: every `sliding_window_pattern`-th layer is global; Mistral:
    # every layer slides.
    local = c.sliding_window is not None and (
        not gemma or (i + 1) % c.sliding_window_pattern)
    mask = causal.copy()
    if local:
      mask &= positions[:, None] - positions[None, :] < c.sliding_window
    theta = c.rope_local_theta if gemma and local else c.rope_theta
    h = rms(x, lp["attn_norm"])
    q, k, v = h @ lp["q"], h @ lp["k"], h @ lp["v"]
    if c.qkv_bias:
      q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
    q, k = q.reshape(-1, h_q, d), k.reshape(-1, h_kv, d)
    if gemma:
      q, k = rms(q, lp["q_norm"]), rms(k, lp["k_norm"])
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    v = v.reshape(-1, h_kv, d)
    heads = []
    for head in range(h_q):
      kv = head // (h_q // h_kv)
      scores = q[:, head] @ k[:, kv].T / np.sqrt(
          c.query_pre_attn_scalar or d)
      scores = np.where(mask, scores, -np.inf)
      w = np.exp(scores - scores.max(-1, keepdims=True))
      heads.append((w / w.sum(-1, keepdims=True)) @ v[:, kv])
    out = np.concatenate(heads, -1) @ lp["o"]
    x = x + (rms(out, lp["attn_post_norm"]) if gemma else out)
    h = rms(x, lp["mlp_norm"])
    gate = h @ lp["gate"]
    act = _gelu_tanh(gate) if gemma else gate / (1 + np.exp(-gate))
    out = (act * (h @ lp["up"])) @ lp["down"]
    x = x + (rms(out, lp["mlp_post_norm"]) if gemma else out)
  x = rms(x, p["final_norm"])
  head = p["embed"].T if c.tie_embeddings else p["lm_head"]
  logits = x @ head
  if c.final_logit_softcap:
    logits = c.final_logit_softcap * np.tanh(logits / c.final_logit_softcap)
  return logits


def _prefilled(model, tokens, size=32):
  """tokens [B, P] prefilled whole -> cache."""
  lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
  _, cache = model.prefill(tokens, lengths, model.init_cache(*lengths.shape,
                                                             size))
  return cache


def _seq(length, seed):
  return np.random.default_rng(seed).integers(0, 128, length).astype(np.int32)


def test_default_geometry_passed_explicitly_is_the_default(model):
  prefix = jnp.asarray(np.stack([_seq(PREFIX, 0), _seq(PREFIX, 1)]))
  chunk = jnp.asarray(np.stack([_seq(4, 2), _seq(4, 3)]))
  cache = _prefilled(model, prefix).rollback(jnp.array([5, 3]))
  default, default_cache = model(chunk, cache)
  positions = cache.lengths[:, None] + jnp.arange(4)[None]
  causal = jnp.tril(jnp.ones((4, 4), bool))[None].repeat(2, 0)
  explicit, explicit_cache = model(chunk, cache, positions=positions,
                                   mask=causal)
  np.testing.assert_array_equal(explicit.logits, default.logits)
  np.testing.assert_array_equal(explicit_cache.k, default_cache.k)
  np.testing.assert_array_equal(explicit.hidden, default.hidden)


def test_unwritten_pass_returns_what_a_written_pass_writes(model):
  # write_cache=False (for callers inside lax.switch) leaves the cache
  # untouched and hands back the chunk's keys and values; writing them with
  # KVCache.write gives the written pass's cache exactly.
  prefix = jnp.asarray(np.stack([_seq(PREFIX, 0), _seq(PREFIX, 1)]))
  chunk = jnp.asarray(np.stack([_seq(4, 2), _seq(4, 3)]))
  cache = _prefilled(model, prefix).rollback(jnp.array([5, 3]))
  written, written_cache = model(chunk, cache)
  out, unwritten = model(chunk, cache, write_cache=False)
  np.testing.assert_array_equal(out.logits, written.logits)
  np.testing.assert_array_equal(unwritten.k, cache.k)
  np.testing.assert_array_equal(unwritten.lengths, cache.lengths + 4)
  assert written.keys is None and out.keys.shape == (
      model.config.num_layers, 2, 4, model.config.num_kv_heads,
      model.config.head_dim)
  again = cache.write(out.keys, out.values, cache.lengths)
  np.testing.assert_array_equal(again.k, written_cache.k)
  np.testing.assert_array_equal(again.v, written_cache.v)
  np.testing.assert_array_equal(again.lengths, written_cache.lengths)
  subset = models.LayerSubset.create(model, exit_layer=1)
  with pytest.raises(ValueError, match="write_cache=False"):
    subset(chunk, subset.init_cache(2, 16), write_cache=False)


def test_causal_forward_matches_the_numpy_reference(model):
  tokens = _seq(9, 4)
  out, _ = model(jnp.asarray(tokens)[None], model.init_cache(1, 16))
  want = _reference_logits(model, tokens, np.arange(9),
                           np.tril(np.ones((9, 9), bool)))
  np.testing.assert_allclose(out.logits[0], want, atol=2e-4, rtol=1e-4)


def test_tree_mask_and_positions_match_the_numpy_reference(model):
  prefix, tree = _seq(PREFIX, 5), _seq(4, 6)
  cache = _prefilled(model, jnp.asarray(prefix)[None])
  positions = PREFIX + DEPTHS
  out, cache = model(jnp.asarray(tree)[None], cache,
                     positions=jnp.asarray(positions)[None],
                     mask=jnp.asarray(TREE_MASK)[None])
  # Reference over prefix + tree: the prefix is causal, tree nodes read the
  # whole prefix and their ancestors.
  n = PREFIX + 4
  mask = np.tril(np.ones((n, n), bool))
  mask[PREFIX:, PREFIX:] = TREE_MASK
  want = _reference_logits(model, np.concatenate([prefix, tree]),
                           np.concatenate([np.arange(PREFIX), positions]),
                           mask)[PREFIX:]
  np.testing.assert_allclose(out.logits[0], want, atol=2e-4, rtol=1e-4)
  np.testing.assert_array_equal(cache.lengths, [n])


def test_compact_then_decode_equals_a_fresh_prefill_of_the_path(model):
  # Score the tree, keep the path 0 -> 2 -> 3 (slots PREFIX + [0, 2, 3]),
  # compact it, then decode one more token: the logits must equal those of
  # the gathered text prefilled from scratch.
  prefix, tree, after = _seq(PREFIX, 7), _seq(4, 8), _seq(1, 9)
  cache = _prefilled(model, jnp.asarray(prefix)[None])
  _, cache = model(jnp.asarray(tree)[None], cache,
                   positions=jnp.asarray(PREFIX + DEPTHS)[None],
                   mask=jnp.asarray(TREE_MASK)[None])
  path = [0, 2, 3]
  cache = cache.compact(jnp.asarray([[PREFIX + i for i in path]]),
                        jnp.array([PREFIX]))
  np.testing.assert_array_equal(cache.lengths, [PREFIX + 3])
  got, _ = model(jnp.asarray(after)[None], cache)
  text = np.concatenate([prefix, tree[path], after])
  fresh, _ = model(jnp.asarray(text)[None], model.init_cache(1, 32))
  np.testing.assert_allclose(got.logits[0, 0], fresh.logits[0, -1],
                             atol=1e-5, rtol=1e-5)
  # Rows compact independently: a second row keeps a different path.
  cache2 = _prefilled(model, jnp.asarray(np.stack([prefix, prefix])))
  _, cache2 = model(jnp.asarray(np.stack([tree, tree])), cache2,
                    positions=jnp.asarray(PREFIX + DEPTHS)[None].repeat(2, 0),
                    mask=jnp.asarray(TREE_MASK)[None])
  cache2 = cache2.compact(jnp.asarray([[PREFIX, PREFIX + 1],
                                       [PREFIX, PREFIX + 2]]),
                          jnp.array([PREFIX, PREFIX]))
  got2, _ = model(jnp.asarray(np.stack([after, after])), cache2)
  for b, keep in enumerate([[0, 1], [0, 2]]):
    text = np.concatenate([prefix, tree[keep], after])
    fresh, _ = model(jnp.asarray(text)[None], model.init_cache(1, 32))
    np.testing.assert_allclose(got2.logits[b, 0], fresh.logits[0, -1],
                               atol=1e-5, rtol=1e-5)


class _RollbackOnly:
  """A cache that resumes from any length but cannot move slots (as the
  docs/api.md's GRU)."""

  def rollback(self, lengths):
    return self


def test_compaction_is_declared_by_the_cache():
  target, _ = testing.tiny_pair()
  assert models.supports_compaction(target.init_cache(1, 8))
  # A stateless fake's cache has nothing to move: trees verify on it.
  fake = testing.FixedLogitsModel(jnp.zeros((4, 4)))
  assert models.supports_compaction(fake.init_cache(1, 8))
  assert not models.supports_compaction(_RollbackOnly())


def test_layer_ranges_compose_and_hidden_layers_are_returned(model):
  tokens = jnp.asarray(_seq(6, 10))[None]
  full, full_cache = model(tokens, model.init_cache(1, 16),
                           hidden_layers=(0,))
  head, cache = model(tokens, model.init_cache(1, 16), layers=(0, 1))
  # The early exit's residual stream is the requested layer-0 output, and
  # its logits are the shared head on the normalised layer-0 state.
  np.testing.assert_allclose(head.residual, full.layer_hidden[0], atol=1e-6)
  assert not np.allclose(head.logits, full.logits, atol=1e-3)
  np.testing.assert_array_equal(cache.k[1], 0)  # layer 1 was not run
  tail, cache = model(None, cache.rollback(jnp.array([0])), layers=(1, 2),
                      residual=head.residual)
  np.testing.assert_allclose(tail.logits, full.logits, atol=1e-5)
  np.testing.assert_allclose(cache.k, full_cache.k, atol=1e-6)
  with pytest.raises(ValueError, match="not a range"):
    model(tokens, model.init_cache(1, 16), layers=(1, 1))
  with pytest.raises(ValueError, match="not run"):
    model(tokens, model.init_cache(1, 16), layers=(0, 1), hidden_layers=(1,))


def test_param_layout_declared_in_config_matches_the_module():
  for config in list(_CONFIGS.values()) + [
      testing.TINY_GEMMA3_TARGET,
      testing.TINY_DRAFT.replace(tie_embeddings=True)]:
    declared = models.param_shapes(config)
    module = models.Transformer(config)
    cache = models.init_random(config, jax.random.key(0)).init_cache(1, 1)
    made = jax.eval_shape(module.init, jax.random.key(0),
                          jnp.zeros((1, 1), jnp.int32), cache)["params"]
    made = jax.tree.map(lambda a: tuple(a.shape), made)
    assert made == jax.tree.map(tuple, declared,
                                is_leaf=lambda x: isinstance(x, tuple))


def test_a_quantized_untied_model_reads_its_packed_head_not_its_embedding():
  """A decode step gathers T rows of a separate LM head's embedding, so
  the bytes it reads leave out the embedding's packed arrays."""
  # pylint: disable=g-import-not-at-top
  import jax
  from specjax.models import init_random
  from specjax.models import tiny
  config = tiny.TINY_TARGET.replace(tie_embeddings=False)
  model = init_random(config, jax.random.key(0)).quantize("int8")
  assert "lm_head" in model.params
  everything = sum(x.nbytes for x in jax.tree.leaves(model.params))
  embedding = sum(x.nbytes for x in jax.tree.leaves(model.params["embed"]))
  assert model.weight_bytes_per_token == everything - embedding
