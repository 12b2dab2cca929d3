"""Tiny model configs with random weights: tests, notebooks, smoke runs and
the `tiny` target of head training.

Shape letters (`specjax.shapes`): V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import init_random
from specjax.models import Model
from specjax.models import ModelConfig

__all__ = ["SHARDABLE_DRAFT", "SHARDABLE_TARGET", "TINY_DRAFT",
           "TINY_TARGET", "tiny_pair"]

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
