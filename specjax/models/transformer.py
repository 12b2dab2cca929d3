"""A Llama-family decoder as a Flax module with an explicit KV cache.

Shape letters: B batch, T tokens in this call, S cache size, E hidden size,
F MLP size, H query heads, K key/value heads, G = H // K query heads per
key/value head, D head dim, V vocab.

One forward serves prefill (T = padded prompt length, offsets 0), decoding
(T = 1) and verification (T = γ + 1): the T tokens of row b sit at absolute
positions `cache.lengths[b] + t`. They attend to the row's valid cache slots
and causally to each other (with a sliding window, only to positions after
`position - window`), then are scattered into the cache at those positions.
Stale cache entries past a row's length are never read, so rollback is only a
change of `cache.lengths`. The cache is read once per layer and never copied
whole: only the new chunk is written.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as cache_lib
from specjax.models.config import ModelConfig
from specjax.models.matmul import MatmulPlan
from specjax.models.matmul import project

_INIT = nn.initializers.normal(0.02)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Rotary inverse frequencies [D // 2], with Llama 3 scaling if configured."""
  d = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, np.float64) / d))
  s = config.rope_scaling
  if s is None:
    return inv_freq.astype(np.float32)
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * np.pi / inv_freq
  smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  mid = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
  out = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
  out = np.where((wavelen <= low_wavelen) & (wavelen >= high_wavelen), mid, out)
  return out.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array,
               inv_freq: np.ndarray) -> jax.Array:
  """Rotates halves of the head dim (the Hugging Face convention).

  Args:
    x: [B, T, N, D] queries or keys.
    positions: [B, T] int32 absolute positions.
    inv_freq: [D // 2].

  Returns:
    [B, T, N, D], same dtype as x.
  """
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """[..., E] -> [..., E]; statistics in fp32 like the reference."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale * x32.astype(x.dtype)


def attention_masks(offsets: jax.Array, num_tokens: int, size: int,
                    window: int | None) -> tuple[jax.Array, jax.Array]:
  """Which keys each query of a chunk may read.

  Queries sit at positions `offsets[b] + t`. Keys are the S cache slots (valid
  below `offsets[b]`) and the chunk itself (causal).

  Args:
    offsets: [B] int32 valid cache length per row.
    num_tokens: T.
    size: S.
    window: sliding window, or None.

  Returns:
    cache_mask [B, T, S] and chunk_mask [1, T, T], bool.
  """
  t = jnp.arange(num_tokens)
  pos = offsets[:, None, None] + t[None, :, None]  # [B, T, 1]
  slots = jnp.arange(size)[None, None, :]
  cache_mask = slots < offsets[:, None, None]
  chunk_mask = t[None, None, :] <= t[None, :, None]
  if window is not None:
    cache_mask &= slots > pos - window
    chunk_mask &= t[None, :, None] - t[None, None, :] < window
  return cache_mask, chunk_mask


class Block(nn.Module):
  """Pre-norm decoder layer: grouped-query attention and a SwiGLU MLP."""

  config: ModelConfig
  param_dtype: jnp.dtype = jnp.float32
  plan: MatmulPlan = MatmulPlan()

  def _param(self, name, shape, init=_INIT):
    return self.param(name, init, shape, self.param_dtype)

  def _dense(self, x: jax.Array, name: str, features_in: int,
             features_out: int) -> jax.Array:
    """x [B, T, in] times weight `name` (stored as the plan says) -> out."""
    w = self._param(name, self.plan.stored_shape((features_in, features_out)))
    return project(x, w, self.plan)

  @nn.compact
  def __call__(self, x: jax.Array, k_cache: jax.Array | None,
               v_cache: jax.Array | None, positions: jax.Array,
               cache_mask: jax.Array | None, chunk_mask: jax.Array):
    """One layer over a chunk.

    Args:
      x: [B, T, E] residual stream.
      k_cache: [B, S, K, D] this layer's cached keys (read only), or None
        when the cache is empty (prefill).
      v_cache: [B, S, K, D] this layer's cached values, or None.
      positions: [B, T] absolute positions of the chunk.
      cache_mask: [B, T, S] which cache slots each query reads, or None.
      chunk_mask: [1, T, T] which chunk tokens each query reads.

    Returns:
      x [B, T, E], and the chunk's keys and values [B, T, K, D] for the cache.
    """
    c = self.config
    e, nh, nk, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    b, t, _ = x.shape
    ones = nn.initializers.ones

    h = rms_norm(x, self._param("attn_norm", (e,), ones), c.rms_norm_eps)
    q = self._dense(h, "q", e, nh * d)
    k = self._dense(h, "k", e, nk * d)
    v = self._dense(h, "v", e, nk * d)
    if c.qkv_bias:
      zeros = nn.initializers.zeros
      q += self._param("q_bias", (nh * d,), zeros)
      k += self._param("k_bias", (nk * d,), zeros)
      v += self._param("v_bias", (nk * d,), zeros)
    inv_freq = rope_inv_freq(c)
    q = apply_rope(q.reshape(b, t, nh, d), positions, inv_freq)
    k = apply_rope(k.reshape(b, t, nk, d), positions, inv_freq)
    v = v.reshape(b, t, nk, d)

    # Queries grouped by key/value head: [B, T, H, D] -> [B, T, K, G, D].
    q = q.reshape(b, t, nk, nh // nk, d) / np.sqrt(d).astype(q.dtype)
    f32 = jnp.float32
    scores = jnp.einsum("btkgd,bukd->bkgtu", q, k,
                        preferred_element_type=f32)  # [B, K, G, T, T]
    scores = jnp.where(chunk_mask[:, None, None], scores, -jnp.inf)
    if k_cache is not None:
      s_cache = jnp.einsum("btkgd,bskd->bkgts", q, k_cache.astype(q.dtype),
                           preferred_element_type=f32)  # [B, K, G, T, S]
      s_cache = jnp.where(cache_mask[:, None, None], s_cache, -jnp.inf)
      scores = jnp.concatenate([s_cache, scores], -1)  # [B, K, G, T, S+T]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    attn = jnp.einsum("bkgtu,bukd->btkgd", probs[..., -t:], v)
    if k_cache is not None:
      attn += jnp.einsum("bkgts,bskd->btkgd", probs[..., :-t],
                         v_cache.astype(v.dtype))  # [B, T, K, G, D]
    x = x + self._dense(attn.reshape(b, t, nh * d), "o", nh * d, e)

    h = rms_norm(x, self._param("mlp_norm", (e,), ones), c.rms_norm_eps)
    gate = self._dense(h, "gate", e, c.intermediate_size)
    up = self._dense(h, "up", e, c.intermediate_size)
    x = x + self._dense(jax.nn.silu(gate) * up, "down", c.intermediate_size,
                        e)
    return x, k, v


class Transformer(nn.Module):
  """The decoder. `__call__` returns hidden states; `logits` projects them.

  Attributes:
    config: the model's static hyper-parameters.
    param_dtype: dtype of freshly initialised parameters.
  """

  config: ModelConfig
  param_dtype: jnp.dtype = jnp.float32
  plan: MatmulPlan = MatmulPlan()

  def setup(self):
    c = self.config
    self.embed = self.param("embed", _INIT, (c.vocab_size, c.hidden_size),
                            self.param_dtype)
    self.layers = [Block(c, self.param_dtype, self.plan)
                   for _ in range(c.num_layers)]
    self.final_norm = self.param("final_norm", nn.initializers.ones,
                                 (c.hidden_size,), self.param_dtype)
    if not c.tie_embeddings:
      self.lm_head = self.param(
          "lm_head", _INIT,
          self.plan.stored_shape((c.hidden_size, c.vocab_size)),
          self.param_dtype)

  def __call__(self, tokens: jax.Array, cache: cache_lib.KVCache,
               cache_is_empty: bool = False):
    """Runs a chunk of tokens per row at the rows' cache offsets.

    Args:
      tokens: [B, T] int32.
      cache: KVCache with k, v [L, B, S, K, D]; row b's chunk goes at
        `cache.lengths[b]`.
      cache_is_empty: static promise that every row's length is 0 (prefill):
        attention then skips the cache, which saves work and keeps XLA from
        constant-folding attention over a zero cache at compile time.

    Returns:
      hidden [B, T, E] (final norm applied) and the cache with the chunk
      written and `lengths` advanced by T.
    """
    offsets = cache.lengths
    num_tokens = tokens.shape[1]
    positions = offsets[:, None] + jnp.arange(num_tokens)[None]  # [B, T]
    cache_mask, chunk_mask = attention_masks(
        offsets, num_tokens, cache.size, self.config.sliding_window)
    x = jnp.take(self.embed, tokens, axis=0)  # [B, T, E]
    ks, vs = [], []
    for i, layer in enumerate(self.layers):
      if cache_is_empty:
        x, k, v = layer(x, None, None, positions, None, chunk_mask)
      else:
        x, k, v = layer(x, cache.k[i], cache.v[i], positions, cache_mask,
                        chunk_mask)
      ks.append(k)
      vs.append(v)
    x = rms_norm(x, self.final_norm, self.config.rms_norm_eps)
    # [L, B, T, K, D] chunks scattered into [L, B, S, K, D] at each row's offset.
    write = jax.vmap(cache_lib.write_rows, in_axes=(0, 0, None))
    new_cache = cache.replace(k=write(cache.k, jnp.stack(ks), offsets),
                              v=write(cache.v, jnp.stack(vs), offsets),
                              lengths=offsets + num_tokens)
    return x, new_cache

  def logits(self, hidden: jax.Array) -> jax.Array:
    """[..., E] -> [..., V] float32."""
    if self.config.tie_embeddings:
      # The embedding [V, E] is always stored [out, in] for this product.
      head, plan = self.embed, dataclasses.replace(self.plan, layout="out_in")
    else:
      head, plan = self.lm_head, self.plan
    return project(hidden, head, plan, out_dtype=jnp.float32)
