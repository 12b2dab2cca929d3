"""Tiny models and fakes for tests, notebooks and smoke runs (the tiny
configs live in `specjax.models.tiny`, re-exported here).

Shape letters (`specjax.shapes`): B batch, T chunk, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.heads.eagle import Eagle
from specjax.heads.eagle import EagleLayer
from specjax.heads.eagle import layer_cache
from specjax.heads.medusa import Medusa
from specjax.heads.medusa import MedusaHeads
from specjax.models import init_random
from specjax.models import DeclaredModel
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models import RopeScaling
from specjax.models.tiny import SHARDABLE_DRAFT
from specjax.models.tiny import SHARDABLE_TARGET
from specjax.models.tiny import gemma3_pair
from specjax.models.tiny import TINY_GEMMA3_DRAFT
from specjax.models.tiny import TINY_GEMMA3_TARGET
from specjax.models.tiny import TINY_DRAFT
from specjax.models.tiny import TINY_TARGET
from specjax.models.tiny import tiny_pair
from specjax.cpu import plans

# Real models' shapes, for random weights where no checkpoint is at hand
# (from their config.json): the Qwen pair (Qwen2.5-Coder-1.5B/0.5B-Instruct)
# and a Llama 3 pair (Meta-Llama-3-8B, and Llama-3.2-1B as its draft): what
# the random-weight benchmarks and `scripts/accelerator_check.sh` run; and
# two mixtures of experts, Mixtral-8x7B (8 experts, top 2) and
# Qwen3-30B-A3B (128 experts, top 8), as `checkpoints.convert.config_from_hf`
# reads their config.json.
_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
REAL_SHAPES = {
    "llama-3-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_embeddings=False),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_ROPE)),
    "llama-3-70b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_embeddings=False),
    "qwen2.5-coder-1.5b-instruct": ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=1536,
        intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
        head_dim=128, rope_theta=1e6, qkv_bias=True, tie_embeddings=True),
    "qwen2.5-coder-0.5b-instruct": ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, rope_theta=1e6, qkv_bias=True, tie_embeddings=True),
    "mixtral-8x7b": ModelConfig(
        arch="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rope_theta=1e6, rms_norm_eps=1e-5,
        tie_embeddings=False, max_position_embeddings=32768, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True,
        router_weights_float32=True),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=768, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=False, max_position_embeddings=40960, qk_norm=True,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
}


def random_model(name: str, seed: int, num_layers: int = 0,
                 dtype: Any = jnp.float32) -> Model:
  """The model `name` of `REAL_SHAPES` with random weights (key `seed`)
  and this machine's matmul plan; with `num_layers` > 0, only that many
  layers; `dtype` "auto" is bf16 on GPU/TPU, fp32 on CPU."""
  config = REAL_SHAPES[name]
  if num_layers:
    config = dataclasses.replace(config, num_layers=num_layers)
  return plans.apply(init_random(config, jax.random.key(seed), dtype),
                     "auto")[0]


def random_prompts(batch: int, vocab: int, length: int) -> list[list[int]]:
  """B prompts of `length` random ids under min(1000, V), seeded by B."""
  rng = np.random.default_rng(batch)
  return rng.integers(1, min(1000, vocab), (batch, length)).tolist()


class Jitted:
  """`model` with `__call__` and `prefill` jitted; every other attribute is
  the model's. For tests that call a model many times at a few shapes: op
  by op, each new shape compiles every primitive of a forward. Keyword
  arguments that are not arrays, jax or numpy (`layers`, `write_cache`),
  are static."""

  def __init__(self, model: Any):
    self.model = model

  def __getattr__(self, name: str) -> Any:
    return getattr(self.model, name)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return _run_jitted(self.model, "__call__", args, kwargs)

  def prefill(self, *args: Any, **kwargs: Any) -> Any:
    return _run_jitted(self.model, "prefill", args, kwargs)


def _run_jitted(model: Any, method: str, args: tuple, kwargs: dict) -> Any:
  arrays = {k: v for k, v in kwargs.items()
            if isinstance(v, (jax.Array, np.ndarray))}
  static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
  return _jitted(method, static)(model, args, arrays)


@functools.cache
def _jitted(method: str, static: tuple) -> Any:
  return jax.jit(lambda model, args, arrays: getattr(model, method)(
      *args, **arrays, **dict(static)))


@flax.struct.dataclass
class LengthCache:
  """A cache that only tracks lengths, for models without state.

  Attributes:
    lengths: [B] int32.
    size: S, the slots a real cache would hold (static).
  """

  lengths: jax.Array
  size: int = flax.struct.field(pytree_node=False, default=0)

  def rollback(self, lengths: jax.Array) -> "LengthCache":
    return self.replace(lengths=lengths.astype(jnp.int32))

  def compact(self, src_slots: jax.Array, lengths: jax.Array
              ) -> "LengthCache":
    """`KVCache.compact` with nothing to move: `lengths` [B] + T of
    `src_slots` [B, T]."""
    return self.rollback(lengths + src_slots.shape[1])


@flax.struct.dataclass
class FixedLogitsModel(DeclaredModel):
  """A `LanguageModel` whose logits depend only on the previous token.

  `table[prev]` is the logit vector after token `prev`, so every expected
  output can be computed by hand. It declares the defaults
  (`DeclaredModel`): it writes its cache as it goes, and a forward reads
  its table.

  Attributes:
    table: [V, V] float32 logits.
  """

  table: jax.Array

  @property
  def vocab_size(self) -> int:
    return self.table.shape[0]

  def init_cache(self, batch: int, size: int) -> LengthCache:
    return LengthCache(jnp.zeros((batch,), jnp.int32), size)

  def __call__(self, tokens, cache, positions=None, mask=None,
               cache_mask=None):
    # A token tree's positions and masks change nothing: each node's
    # logits follow its own token.
    del positions, mask, cache_mask
    return self.table[tokens], cache.rollback(cache.lengths + tokens.shape[1])

  def prefill(self, tokens, lengths, cache):
    last = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
    return self.table[last], cache.rollback(lengths)


def _randomized(shapes, seed: int, scale: float):
  leaves, tree = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [
      scale * jax.random.normal(k, x.shape, x.dtype)
      for k, x in zip(keys, leaves)])


def random_medusa(target: Model, num_heads: int = 3, seed: int = 1,
                  scale: float = 0.3) -> Medusa:
  """`Medusa` heads on `target` with random (untrained) weights."""
  module = MedusaHeads(num_heads, target.config.hidden_size)
  shapes = jax.eval_shape(lambda: module.init(
      jax.random.key(0), jnp.zeros((1, target.config.hidden_size))))
  return Medusa(target=target, params=_randomized(shapes["params"], seed,
                                                  scale),
                num_heads=num_heads)


def random_eagle(target: Model, seed: int = 1, scale: float = 0.1) -> Eagle:
  """An `Eagle` layer on `target` with random (untrained) weights."""
  c = target.config
  zeros = jnp.zeros((1, 1, c.hidden_size))
  shapes = jax.eval_shape(lambda: EagleLayer(c).init(
      jax.random.key(0), zeros, zeros, layer_cache(c, 1, 1)))
  return Eagle(target=target,
               params=_randomized(shapes["params"], seed, scale))


# Where each GGUF block type keeps its float16 scales (byte offsets).
_F16_FIELDS = {"Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: Any, rows: int, blocks: int,
                  seed: int = 0) -> np.ndarray:
  """[rows, blocks * type_size] uint8: random GGUF blocks of `qtype` (a
  `gguf.GGMLQuantizationType` in Q8_0, Q5_0, Q4_K, Q6_K) with finite
  float16 scales."""
  import gguf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  _, size = gguf.GGML_QUANT_SIZES[qtype]
  data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
  for start in _F16_FIELDS[qtype.name]:
    scale = rng.normal(0, 0.02, (rows, blocks, 1)).astype(np.float16)
    data[..., start:start + 2] = scale.view(np.uint8)
  return data.reshape(rows, blocks * size)
