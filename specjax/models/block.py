"""One decoder layer (`Block`) and the pieces it is built from: rotary
embeddings, RMSNorm, soft-capping.

Shape letters (`specjax.shapes`): B batch, T tokens in this call, S cache
size, E hidden size, F MLP size, H query heads, K key/value heads, R = H //
K query heads per key/value head, D head dim, X experts.

`Transformer` (`specjax.models.transformer`) runs the layers and owns the
geometry; a `Block` takes the positions and masks it is given.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import LinearRopeScaling
from specjax.models.config import ModelConfig
from specjax.models.matmul import LayerPick
from specjax.models.matmul import MatmulPlan
from specjax.models.matmul import project
from specjax.models import moe
from specjax.models import quantized

_INIT = nn.initializers.normal(0.02)


def rope_inv_freq(config: ModelConfig, layer: int = 0) -> np.ndarray:
  """Rotary inverse frequencies [D // 2] of layer `layer`, with Llama 3 or
  linear scaling if configured."""
  d = config.head_dim
  theta, s = config.layer_rope(layer)
  inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, np.float64) / d))
  if s is None:
    return inv_freq.astype(np.float32)
  if isinstance(s, LinearRopeScaling):
    return (inv_freq / s.factor).astype(np.float32)
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


def rms_norm(x: jax.Array, scale: jax.Array, eps: float,
             plus_one: bool = False) -> jax.Array:
  """[..., E] -> [..., E]; statistics in fp32 like the reference.

  Llama scales the normalised x, cast back to x's dtype, by `scale`; Gemma
  (`plus_one`) scales it in float32 by (1 + scale), then casts.
  """
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if plus_one:
    return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
  return scale * x32.astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(x / cap) elementwise (Gemma's soft-capping); x if None."""
  if cap is None:
    return x
  return cap * jnp.tanh(x / cap)

def param(module: nn.Module, name: str, shape, dtype, init=_INIT):
  """`module.param`, or a `QuantizedMatrix`, `LayerPick` or `moe.Stacked`
  given for it as is (Flax's shape check would compare its arrays with
  the float shape)."""
  if module.has_variable("params", name):
    w = module.get_variable("params", name)
    if quantized.is_quantized(w) or isinstance(w, (LayerPick, moe.Stacked)):
      return w
  return module.param(name, init, shape, dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array,
           k_cache: jax.Array | None, v_cache: jax.Array | None,
           cache_mask: jax.Array | None, chunk_mask: jax.Array,
           cap: float | None) -> jax.Array:
  """Grouped-query attention of a chunk over the cache, then the chunk.

  Args:
    q: [B, T, K, R, D] scaled queries.
    k, v: [B, T, K, D] the chunk's keys and values.
    k_cache, v_cache: [B, S, K, D] the cache's, or None (prefill).
    cache_mask: [B, T, S] bool (with a cache); chunk_mask [B or 1, T, T].
    cap: the scores' soft cap, or None.

  Returns:
    [B, T, K, R, D].
  """
  f32 = jnp.float32
  t = q.shape[1]
  scores = jnp.einsum("btkrd,bukd->bkrtu", q, k,
                      preferred_element_type=f32)  # [B, K, R, T, T]
  scores = softcap(scores, cap)
  scores = jnp.where(chunk_mask[:, None, None], scores, -jnp.inf)
  if k_cache is not None:
    s_cache = jnp.einsum("btkrd,bskd->bkrts", q, k_cache.astype(q.dtype),
                         preferred_element_type=f32)  # [B, K, R, T, S]
    s_cache = softcap(s_cache, cap)
    s_cache = jnp.where(cache_mask[:, None, None], s_cache, -jnp.inf)
    scores = jnp.concatenate([s_cache, scores], -1)  # [B, K, R, T, S+T]
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  attn = jnp.einsum("bkrtu,bukd->btkrd", probs[..., -t:], v)
  if k_cache is not None:
    attn += jnp.einsum("bkrts,bskd->btkrd", probs[..., :-t],
                       v_cache.astype(v.dtype))
  return attn


# Query rows `attend_by_row` writes out one by one; more go through a loop.
_UNROLLED_ROWS = 16


def attend_by_row(q: jax.Array, k: jax.Array, v: jax.Array,
                  k_cache: jax.Array, v_cache: jax.Array,
                  cache_mask: jax.Array, chunk_mask: jax.Array,
                  chunk_slots: jax.Array, cap: float | None) -> jax.Array:
  """`attend` with each query row's sums in the order of a one-token step.

  XLA's dots and reductions over T rows at once group their sums by T, so
  a verification pass would round differently from decode steps; with
  int8 activations such differences change the codes the next product
  reads. Here the chunk's keys and values go into the cache at
  `chunk_slots` first (a copy: the cache itself is written after the
  layers), so that a key sits at the same index of every sum whether it
  came in this chunk or an earlier one; then each query row attends
  alone, in the shapes of a one-token step: written out up to
  `_UNROLLED_ROWS` rows (a verification pass costs what `attend` does),
  in a `lax.map` above, the same values at a loop's overhead per row.

  Args:
    q: [B, T, K, R, D] scaled queries; k, v: [B, T, K, D].
    k_cache, v_cache: [B, S, K, D]; cache_mask: [B, T, S] bool.
    chunk_mask: [B or 1, T, T] bool; chunk_slots: [B] int32, where each
      row's chunk goes (its cache length).
    cap: the scores' soft cap, or None.

  Returns:
    [B, T, K, R, D], the same values as `attend` up to rounding.
  """
  b, t = q.shape[:2]
  size = k_cache.shape[1]
  place = jax.vmap(lambda c, x, at: jax.lax.dynamic_update_slice_in_dim(
      c, x.astype(c.dtype), at, axis=0))
  keys = place(k_cache, k, chunk_slots).astype(q.dtype)  # [B, S, K, D]
  values = place(v_cache, v, chunk_slots).astype(v.dtype)
  # Which slots each query reads: the cache's below the chunk, then the
  # chunk's own by chunk_mask.
  rel = jnp.arange(size)[None, :] - chunk_slots[:, None]  # [B, S]
  in_chunk = (rel >= 0) & (rel < t)
  own = jnp.take_along_axis(
      jnp.broadcast_to(chunk_mask, (b, t, t)),
      jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None], (b, t, size)),
      axis=2)
  mask = jnp.where(in_chunk[:, None], own, cache_mask)  # [B, T, S]

  def row(q_row, m_row):  # [B, 1, K, R, D], [B, 1, S] -> [B, 1, K, R, D]
    scores = jnp.einsum("btkrd,bskd->bkrts", q_row, keys,
                        preferred_element_type=jnp.float32)
    scores = softcap(scores, cap)
    scores = jnp.where(m_row[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("bkrts,bskd->btkrd", probs, values)

  if t <= _UNROLLED_ROWS:
    return jnp.concatenate([row(q[:, i:i + 1], mask[:, i:i + 1])
                            for i in range(t)], axis=1)
  rows = jax.lax.map(lambda a: row(*a), (q[:, :, None].swapaxes(0, 1),
                                         mask[:, :, None].swapaxes(0, 1)))
  return rows[:, :, 0].swapaxes(0, 1)  # [T, B, 1, ...] -> [B, T, ...]


class Block(nn.Module):
  """Pre-norm decoder layer: grouped-query attention and a gated MLP
  (SwiGLU, or Gemma's GeGLU with QK-norm and post-norms), or a mixture of
  gated MLPs (`specjax.models.moe`) when `config.num_experts` > 0.

  Attributes:
    config: the model.
    param_dtype: dtype of freshly initialised parameters.
    plan: how matrix products are computed.
    layer: this layer's index, which fixes its rope (`config.layer_rope`);
      its window comes in through the masks the caller passes.
  """

  config: ModelConfig
  param_dtype: jnp.dtype = jnp.float32
  plan: MatmulPlan = MatmulPlan()
  layer: int = 0

  def _param(self, name, shape, init=_INIT):
    return param(self, name, shape, self.param_dtype, init)

  def _dense(self, x: jax.Array, name: str, features_in: int,
             features_out: int) -> jax.Array:
    """x [B, T, in] times weight `name` (stored as the plan says) -> out."""
    w = self._param(name, self.plan.stored_shape((features_in, features_out)))
    return project(x, w, self.plan)

  def _norm(self, x: jax.Array, name: str) -> jax.Array:
    """RMSNorm over x's last axis with scale `name` [x.shape[-1]]; a
    (1 + w) scale starts at w = 0."""
    c = self.config
    init = nn.initializers.zeros if c.norm_plus_one else nn.initializers.ones
    scale = self._param(name, (x.shape[-1],), init)
    return rms_norm(x, scale, c.rms_norm_eps, c.norm_plus_one)

  def _mlp(self, h: jax.Array, prefix: str, size: int) -> jax.Array:
    """The gated MLP of matrices `{prefix}gate`, `up`, `down`: [B, T, E]
    -> [B, T, E]."""
    c = self.config
    e = c.hidden_size
    gate = self._dense(h, f"{prefix}gate", e, size)
    up = self._dense(h, f"{prefix}up", e, size)
    return self._dense(moe.activate(gate, up, c.activation),
                       f"{prefix}down", size, e)

  def _moe(self, h: jax.Array) -> jax.Array:
    """The routed experts, plus the sigmoid-gated shared expert if any:
    [B, T, E] -> [B, T, E] (transformers' `*SparseMoeBlock`)."""
    c = self.config
    e, f, x = c.hidden_size, c.intermediate_size, c.num_experts
    logits = self._dense(h, "router", e, x)  # [B, T, X]
    ws = moe.Experts.of(self._param("experts_gate", (x, f, e)),
                        self._param("experts_up", (x, f, e)),
                        self._param("experts_down", (x, f, e)))
    # Up to the plan's kernel_max_rows rows, its kernel reads each chosen
    # expert in place: 9x XLA's slice-then-dot at one row, 2x at 16, even
    # by 64 (scripts/bench_moe.py). Packed experts go to it at any rows,
    # as packed matrices do: XLA would dequantise each one a pass reads.
    plan = self.plan
    near = (h.shape[0] * h.shape[1] <= plan.kernel_max_rows
            or quantized.is_quantized(ws.gate))
    out, woken = moe.apply_experts(h, logits, ws, c,
                                   kernel=plan.kernel if near else None)
    # Read by `Model.forward` (`TransformerOutput.experts`).
    self.sow("intermediates", "experts", woken)
    if c.shared_expert_size:
      shared = self._mlp(h, "shared_", c.shared_expert_size)
      gate = self._dense(h, "shared_expert_gate", e, 1)  # [B, T, 1]
      out = out + jax.nn.sigmoid(gate) * shared
    return out

  @nn.compact
  def __call__(self, x: jax.Array, k_cache: jax.Array | None,
               v_cache: jax.Array | None, positions: jax.Array,
               cache_mask: jax.Array | None, chunk_mask: jax.Array,
               chunk_slots: jax.Array | None = None):
    """One layer over a chunk.

    Args:
      x: [B, T, E] residual stream.
      k_cache: [B, S, K, D] this layer's cached keys (read only; a local
        layer may get only its window's [B, W, K, D]), or None when the
        cache is empty (prefill).
      v_cache: [B, S or W, K, D] this layer's cached values, or None.
      positions: [B, T] absolute positions of the chunk.
      cache_mask: [B, T, S or W] which cache slots each query reads, or
        None.
      chunk_mask: [B or 1, T, T] which chunk tokens each query reads.
      chunk_slots: [B] int32, the slot of k_cache where each row's chunk
        will be written: with a cache, attention then takes one query row
        at a time and reads the chunk there (`attend_by_row`,
        `MatmulPlan.row_invariant`); None: all rows at once (`attend`).

    Returns:
      x [B, T, E], and the chunk's keys and values [B, T, K, D] for the cache.
    """
    c = self.config
    e, nh, nk, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    b, t, _ = x.shape

    with jax.named_scope("attention"):
      h = self._norm(x, "attn_norm")
      q = self._dense(h, "q", e, nh * d)
      k = self._dense(h, "k", e, nk * d)
      v = self._dense(h, "v", e, nk * d)
      if c.qkv_bias:
        zeros = nn.initializers.zeros
        q += self._param("q_bias", (nh * d,), zeros)
        k += self._param("k_bias", (nk * d,), zeros)
        v += self._param("v_bias", (nk * d,), zeros)
      if c.qk_norm and not c.qk_norm_per_head:  # over the projections
        q, k = self._norm(q, "q_norm"), self._norm(k, "k_norm")
      q, k = q.reshape(b, t, nh, d), k.reshape(b, t, nk, d)
      if c.qk_norm and c.qk_norm_per_head:
        q, k = self._norm(q, "q_norm"), self._norm(k, "k_norm")
      inv_freq = rope_inv_freq(c, self.layer)
      q = apply_rope(q, positions, inv_freq)
      k = apply_rope(k, positions, inv_freq)
      v = v.reshape(b, t, nk, d)

      # Queries grouped by key/value head: [B, T, H, D] -> [B, T, K, R, D].
      scale = c.query_pre_attn_scalar or d
      q = q.reshape(b, t, nk, nh // nk, d) / np.sqrt(scale).astype(q.dtype)
      if k_cache is not None and chunk_slots is not None:
        attn = attend_by_row(q, k, v, k_cache, v_cache, cache_mask,
                             chunk_mask, chunk_slots, c.attn_logit_softcap)
      else:
        attn = attend(q, k, v, k_cache, v_cache, cache_mask, chunk_mask,
                      c.attn_logit_softcap)
      out = self._dense(attn.reshape(b, t, nh * d), "o", nh * d, e)
      if c.post_norms:
        out = self._norm(out, "attn_post_norm")
      x = x + out

    with jax.named_scope("mlp"):
      h = self._norm(x, "mlp_norm")
      if c.num_experts:
        out = self._moe(h)
      else:
        out = self._mlp(h, "", c.intermediate_size)
      if c.post_norms:
        out = self._norm(out, "mlp_post_norm")
      x = x + out
    return x, k, v
