"""Tiny model configs with random weights: tests, notebooks, smoke runs and
the `tiny` target of head training (Llama-family, and Gemma 3).

Shape letters (`specjax.shapes`): V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import init_random
from specjax.models import Model
from specjax.models import ModelConfig

__all__ = ["SHARDABLE_DRAFT", "SHARDABLE_TARGET", "TINY_DRAFT",
           "TINY_GEMMA3_DRAFT", "TINY_GEMMA3_TARGET", "TINY_TARGET",
           "gemma3_pair", "tiny_pair"]

TINY_TARGET = ModelConfig(
    arch="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
TINY_DRAFT = ModelConfig(
    arch="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)

# Every split dimension divisible by 8 (heads, key/value heads, MLP, vocab),
# with Qwen2's q/k/v biases, so each rule of `specjax.sharding` applies on a
# model axis of up to 8 devices.
SHARDABLE_TARGET = ModelConfig(
    arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8, qkv_bias=True,
    tie_embeddings=False)
SHARDABLE_DRAFT = ModelConfig(
    arch="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
    num_layers=1, num_heads=8, num_kv_heads=8, head_dim=4)

# Gemma 3 at toy size: local, local, global, local (the 5:1 pattern shrunk
# to 2:1, not dividing the layers), a window of 4 that test prompts outrun,
# head_dim 24 != hidden / heads, query_pre_attn_scalar 20 != head_dim, a
# soft-cap on the logits. The draft is a smaller Gemma (local, global).
TINY_GEMMA3_TARGET = ModelConfig(
    arch="gemma3", vocab_size=128, hidden_size=64, intermediate_size=128,
    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=24, rope_theta=1e6,
    tie_embeddings=True, sliding_window=4, sliding_window_pattern=3,
    rope_local_theta=1e4, norm_plus_one=True, qk_norm=True, post_norms=True,
    activation="gelu_tanh", scale_embeddings=True, query_pre_attn_scalar=20.0,
    final_logit_softcap=3.0)
TINY_GEMMA3_DRAFT = TINY_GEMMA3_TARGET.replace(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=16, sliding_window_pattern=2)


def gemma3_pair(seed: int = 0, vocab_size: int = 128,
                dtype=jnp.float32) -> tuple[Model, Model]:
  """A random tiny Gemma 3 (target, draft) pair of vocabulary V =
  `vocab_size`, every norm scale redrawn (Gemma initialises its (1 + w)
  scales at w = 0, which would hide a dropped norm)."""
  models = []
  for key, config in zip(jax.random.split(jax.random.key(seed)),
                         (TINY_GEMMA3_TARGET, TINY_GEMMA3_DRAFT)):
    init_key, norm_key = jax.random.split(key)
    model = init_random(config.replace(vocab_size=vocab_size), init_key,
                        dtype)
    leaves, tree = jax.tree_util.tree_flatten_with_path(model.params)
    keys = jax.random.split(norm_key, len(leaves))
    leaves = [
        x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
        if "norm" in jax.tree_util.keystr(path) else x
        for (path, x), k in zip(leaves, keys)]
    models.append(model.replace(params=jax.tree.unflatten(tree, leaves)))
  return models[0], models[1]


def tiny_pair(seed: int = 0, vocab_size: int = 128,
              dtype=jnp.float32, shardable: bool = False
              ) -> tuple[Model, Model]:
  """A random tiny (target, draft) pair sharing a vocabulary of V =
  `vocab_size` (`shardable`: the SHARDABLE_* configs, vocab_size
  ignored)."""
  t_key, d_key = jax.random.split(jax.random.key(seed))
  if shardable:
    return (init_random(SHARDABLE_TARGET, t_key, dtype),
            init_random(SHARDABLE_DRAFT, d_key, dtype))
  target = init_random(TINY_TARGET.replace(vocab_size=vocab_size), t_key,
                       dtype)
  draft = init_random(TINY_DRAFT.replace(vocab_size=vocab_size), d_key, dtype)
  return target, draft
