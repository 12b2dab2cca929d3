"""A Llama- or Gemma-family decoder as a Flax module with an explicit KV
cache.

Shape letters (`specjax.shapes`): B batch, T tokens in this call, S cache
size, L layers, E hidden size, F MLP size, H query heads, K key/value heads,
R = H // K query heads per key/value head, D head dim, V vocab.

One forward serves prefill (T = padded prompt length, offsets 0), decoding
(T = 1), verification (T = γ + 1) and token trees. The caller owns the
geometry: the T tokens of row b are written to cache slots
`cache.lengths[b] + t` and sit at `positions[b, t]` (default: the slot), and
`mask[b, t, u]` says which chunk tokens each query reads (default: causal).
Queries also read the row's valid cache slots; cache slots hold consecutive
positions (slot s is position s, which `KVCache.compact` maintains), so a
sliding window is computed from positions, never from index differences.
Gemma 3's local and global layers each read their own mask and rope
(`ModelConfig.layer_window`, `ModelConfig.layer_rope`); once the cache holds
at least twice a local layer's window W, that layer reads only a W-slot slice
of it per row (`window_start`), so its cost stops growing with S.
Stale cache entries past a row's length are never read, so rollback is only a
change of `cache.lengths`. The cache is read once per layer and never copied
whole: only the new chunk is written.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as cache_lib
from specjax.models.block import Block
from specjax.models.block import param
from specjax.models.block import rms_norm
from specjax.models.block import softcap
from specjax.models.config import EXPERT_PARAMS
from specjax.models.config import ModelConfig
from specjax.models.matmul import LayerPick
from specjax.models.matmul import MatmulPlan
from specjax.models.matmul import project
from specjax.models import quantized
from specjax.models import stacking

def default_positions(offsets: jax.Array, num_tokens: int) -> jax.Array:
  """[B] cache lengths -> [B, T] positions of a chunk written after them."""
  return offsets[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None]


def causal_mask(num_tokens: int) -> jax.Array:
  """[1, T, T] bool, query t reads chunk tokens u <= t."""
  t = jnp.arange(num_tokens)
  return (t[None, :] <= t[:, None])[None]


def attention_masks(offsets: jax.Array, positions: jax.Array,
                    mask: jax.Array, size: int, window: int | None,
                    start: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
  """Which keys each query of a chunk may read.

  Args:
    offsets: [B] int32 valid cache length per row (slot s holds position s).
    positions: [B, T] int32 positions of the chunk's tokens.
    mask: [B or 1, T, T] bool, which chunk tokens each query reads.
    size: S, or the window W when `start` is given.
    window: sliding window, or None: a query at position p then reads only
      keys at positions > p - window.
    start: [B] int32 first slot of the cache slice the layer reads
      (`window_start`), or None for all S slots.

  Returns:
    cache_mask [B, T, S or W] and chunk_mask [B or 1, T, T], bool.
  """
  slots = jnp.arange(size)[None, None, :]
  if start is not None:
    slots = slots + start[:, None, None]
  cache_mask = slots < offsets[:, None, None]
  chunk_mask = mask
  if window is not None:
    query = positions[:, :, None]  # [B, T, 1]
    cache_mask &= slots > query - window
    chunk_mask &= query - positions[:, None, :] < window
  return cache_mask, chunk_mask


def window_start(positions: jax.Array, size: int,
                 window: int | None) -> jax.Array | None:
  """Where a local layer's window of W = `window` cache slots starts per
  row, or None to read all S = `size` slots (a global layer, or S < 2W,
  where a copied window saves nothing).

  A query at position p reads slots in (p - W, length); with every position
  of the chunk at least the row's length (chains, trees verified after it,
  prefill chunks), slots [min p - W + 1, min p + 1) hold all of them.

  Args:
    positions: [B, T] int32 positions of the chunk.
    size: S.
    window: the sliding window W, or None.

  Returns:
    [B] int32 first slot of each row's window, in [0, S - W].
  """
  if window is None or size < 2 * window:
    return None
  lowest = jnp.min(positions, axis=1)
  return jnp.clip(lowest - (window - 1), 0, size - window).astype(jnp.int32)


def window_slots(cache_k: jax.Array, start: jax.Array,
                 window: int) -> jax.Array:
  """[B, S, K, D] cache and [B] starts -> each row's [B, W, K, D] window."""
  return jax.vmap(lambda rows, at: jax.lax.dynamic_slice_in_dim(
      rows, at, window, axis=0))(cache_k, start)

@flax.struct.dataclass(kw_only=True)
class TransformerOutput:
  """What one pass over a chunk returns.

  Attributes:
    hidden: [B, T, E] the last layer run's output, final norm applied (the
      input of the LM head).
    residual: [B, T, E] the same before the final norm (the input of the
      next layer, to continue a layer range).
    cache: the cache with the chunk written, `lengths` advanced by T (with
      `write_cache=False`, nothing written: only `lengths` advanced).
    layer_hidden: one [B, T, E] residual stream per requested layer.
    keys: [l, B, T, K, D] the chunk's keys for the l layers run, when the
      pass did not write them (`write_cache=False`), else None.
    values: [l, B, T, K, D] the same for values.
    experts: [] int32 for a mixture of experts, the distinct experts the
      pass woke, summed over its layers (`Model.forward`); else None.
  """

  hidden: jax.Array
  residual: jax.Array
  cache: cache_lib.KVCache
  layer_hidden: tuple[jax.Array, ...] = ()
  keys: jax.Array | None = None
  values: jax.Array | None = None
  experts: jax.Array | None = None

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
    self.embed = param(self, "embed", (c.vocab_size, c.hidden_size),
                        self.param_dtype)
    # With `plan.scan_layers` the layers are one stacked dict
    # (`stacking.KEY`), run by `_scanned`.
    self.layers = [] if self.plan.scan_layers else [
        Block(c, self.param_dtype, self.plan, layer=i)
        for i in range(c.num_layers)]
    norm_init = (nn.initializers.zeros if c.norm_plus_one
                 else nn.initializers.ones)
    self.final_norm = self.param("final_norm", norm_init,
                                 (c.hidden_size,), self.param_dtype)
    if not c.tie_embeddings:
      self.lm_head = param(
          self, "lm_head",
          self.plan.stored_shape((c.hidden_size, c.vocab_size)),
          self.param_dtype)

  def __call__(self, tokens: jax.Array | None, cache: cache_lib.KVCache, *,
               positions: jax.Array | None = None,
               mask: jax.Array | None = None,
               layers: tuple[int, int] | None = None,
               residual: jax.Array | None = None,
               hidden_layers: tuple[int, ...] = (),
               cache_is_empty: bool = False,
               cache_mask: jax.Array | None = None,
               write_cache: bool = True,
               prefill: bool = False) -> "TransformerOutput":
    """Runs a chunk of tokens per row at the rows' cache offsets.

    Args:
      tokens: [B, T] int32, embedded as the input of the first layer run;
        None when `residual` is given instead.
      cache: KVCache with k, v [L, B, S, K, D]; row b's chunk goes to slots
        `cache.lengths[b] + t`.
      positions: [B, T] int32 positions of the chunk (default: the slots).
      mask: [B or 1, T, T] bool chunk attention (default: causal).
      layers: static (start, stop), run only layers start..stop-1 (early
        exit; default all). Only their cache layers are written.
      residual: [B, T, E] the residual stream entering layer `start`
        (`TransformerOutput.residual` of a run that stopped there).
      hidden_layers: static layer indices whose outputs (residual stream
        after that layer) are returned, e.g. for EAGLE-3 feature fusion.
      cache_is_empty: static promise that every row's length is 0 (prefill):
        attention then skips the cache, which saves work and keeps XLA from
        constant-folding attention over a zero cache at compile time.
      cache_mask: [B, T, S] bool, further restricts which cache slots below
        the row's length each query reads (default: all of them). A tree
        drafter that keeps earlier tree levels in the cache shows each node
        only its own ancestors. The sliding window still assumes slot s
        holds position s.
      write_cache: static; False leaves the cache unwritten and returns the
        chunk's keys and values instead (`TransformerOutput.keys`), for a
        caller that writes them itself (`KVCache.write`): inside a
        `lax.switch` branch, an in-place write forces XLA to copy the
        whole cache first, every step.
      prefill: static; a prompt chunk (`Decoder.prefill`), whose rows are
        compared with no one-token step: attention takes them all at once
        even on a `MatmulPlan.row_invariant` plan.

    Returns:
      A `TransformerOutput`; the cache in it has the chunk written and
      `lengths` advanced by T.
    """
    c = self.config
    first, stop = (0, c.num_layers) if layers is None else layers
    if not 0 <= first < stop <= c.num_layers:
      raise ValueError(f"layers={layers} is not a range within the "
                       f"{c.num_layers} layers.")
    if (residual is None) == (tokens is None):
      raise ValueError("Pass exactly one of tokens and residual.")
    if residual is None:
      x = quantized.take(self.embed, tokens)  # [B, T, E]
      if c.scale_embeddings:
        # sqrt(E) rounded to the embedding's dtype first, as Gemma does.
        x = x * jnp.asarray(np.float32(np.sqrt(c.hidden_size)), x.dtype)
    else:
      x = residual
    batch, num_tokens, _ = x.shape  # [B, T, E]
    offsets = cache.lengths
    if positions is None:
      positions = default_positions(offsets, num_tokens)
    if mask is None:
      mask = causal_mask(num_tokens)
    # (cache mask [B, T, S or W], chunk mask [B or 1, T, T], window start
    # [B] or None) per window run. Local layers read only their window's
    # slots of a long cache (`window_start`); a caller's own cache mask
    # (tree drafts kept in the cache) sees every slot.
    # Attention by row where it buys exactness: with the kernel's
    # row-invariant products, and on rows compared with one-token steps.
    by_row = bool(self.plan.row_invariant and self.plan.kernel
                  and not prefill)
    masks = {}
    for window in sorted({c.layer_window(i) for i in range(first, stop)},
                         key=str):
      start = (None if cache_mask is not None or cache_is_empty or by_row
               else window_start(positions, cache.size, window))
      cache_m, chunk_m = attention_masks(
          offsets, positions, mask,
          cache.size if start is None else window, window, start)
      if cache_mask is not None:
        cache_m &= cache_mask
      masks[window] = (cache_m, chunk_m, start)
    # Where each row's chunk goes, for attention by row (None: at once).
    chunk_slots = cache.lengths if by_row else None
    if self.plan.scan_layers:
      x, keys, values, chosen = self._scanned(
          x, cache, positions, masks, chunk_slots, first, stop,
          hidden_layers, cache_is_empty)
    elif self._loops(first, stop, x):
      x, keys, values, chosen = self._layer_loop(
          x, cache, positions, masks, chunk_slots, first, stop,
          hidden_layers, cache_is_empty)
    else:
      x, keys, values, chosen = self._unrolled(
          x, cache, positions, masks, chunk_slots, first, stop,
          hidden_layers, cache_is_empty)
    missing = set(hidden_layers) - set(chosen)
    if missing:
      raise ValueError(f"hidden_layers {sorted(missing)} are not run by "
                       f"layers={layers}.")
    hidden = rms_norm(x, self.final_norm, c.rms_norm_eps, c.norm_plus_one)
    layer_hidden = tuple(chosen[i] for i in hidden_layers)
    if not write_cache:
      return TransformerOutput(
          hidden=hidden, residual=x,
          cache=cache.rollback(offsets + num_tokens),
          layer_hidden=layer_hidden, keys=keys, values=values)
    keys, values = cache_lib.after(hidden, keys, values)
    return TransformerOutput(
        hidden=hidden, residual=x,
        cache=cache.write(keys, values, offsets, first),
        layer_hidden=layer_hidden)

  def _loops(self, first: int, stop: int, x: jax.Array) -> bool:
    """Whether layers first..stop-1 run as one `lax.scan` (`_layer_loop`)
    rather than unrolled: on a plan with a kernel that multiplies every
    one of their matrices in place (`MatmulPlan.loops`), for layers that
    share one window and rope (Llama, Qwen2, Mistral; not Gemma 3's local
    and global mix).

    An unrolled program holds a copy of every layer, so its compile time
    grows with L (BENCHMARKS.md "Compile"). A loop needs products that
    read the layer's matrix in place, which the kernel does (`LayerPick`);
    XLA's dot copies a sliced matrix first.
    """
    c = self.config
    shared = {(c.layer_window(i), c.layer_rope(i))
              for i in range(first, stop)}
    # A mixture of experts' stacked experts are no kernel matrices: a loop
    # would stack every layer's [X, ...] experts per call.
    if stop - first < 2 or len(shared) != 1 or c.num_experts:
      return False
    params = self.variables.get("params", {})
    if not all(f"layers_{i}" in params for i in range(first, stop)):
      return False
    return self.plan.loops(
        [params[f"layers_{i}"] for i in range(first, stop)], x.dtype)

  def _unrolled(self, x, cache, positions, masks, chunk_slots, first,
                stop, hidden_layers, cache_is_empty):
    """Layers first..stop-1 one after another, each its own code.

    Returns:
      x [B, T, E], keys and values [l, B, T, K, D], and {layer: [B, T, E]}
      for `hidden_layers`.
    """
    c = self.config
    ks, vs, chosen = [], [], {}
    for i in range(first, stop):
      window = c.layer_window(i)
      cache_m, chunk_m, start = masks[window]
      with jax.named_scope(f"layer_{i}"):
        if cache_is_empty:
          x, k, v = self.layers[i](x, None, None, positions, None, chunk_m)
        else:
          k_cache, v_cache = cache.k[i], cache.v[i]
          if start is not None:
            k_cache = window_slots(k_cache, start, window)
            v_cache = window_slots(v_cache, start, window)
          x, k, v = self.layers[i](x, k_cache, v_cache, positions,
                                   cache_m, chunk_m, chunk_slots)
      ks.append(k)
      vs.append(v)
      if i in hidden_layers:
        chosen[i] = x
    return x, jnp.stack(ks), jnp.stack(vs), chosen

  def _layer_loop(self, x, cache, positions, masks, chunk_slots, first,
                  stop, hidden_layers, cache_is_empty):
    """Layers first..stop-1 as one `lax.scan` over the layer index: one
    copy of the layer's code, whose matrices are `LayerPick`s of every
    layer's (read in place by the kernel) and whose norms and biases are
    rows of arrays stacked [l, ...] per call (a few KiB a layer).

    Same arguments and results as `_unrolled`.
    """
    c = self.config
    window = c.layer_window(first)
    cache_m, chunk_m, start = masks[window]
    layers = [self.variables["params"][f"layers_{i}"]
              for i in range(first, stop)]
    matrices = {name for name, w in layers[0].items() if w.ndim == 2}
    stacked = {name: jnp.stack([p[name] for p in layers])
               for name in layers[0] if name not in matrices}
    block = Block(c, self.param_dtype, self.plan, layer=first, parent=None)

    def body(x, i):
      params = {name: w[i - first] for name, w in stacked.items()}
      params.update({name: LayerPick(ws=tuple(p[name] for p in layers),
                                     index=i - first) for name in matrices})
      if cache_is_empty:
        k_cache = v_cache = None
      else:
        k_cache, v_cache = cache.k[i], cache.v[i]
        if start is not None:
          k_cache = window_slots(k_cache, start, window)
          v_cache = window_slots(v_cache, start, window)
      x, k, v = block.apply({"params": params}, x, k_cache, v_cache,
                            positions, cache_m, chunk_m, chunk_slots)
      return x, (k, v, x if hidden_layers else None)

    with jax.named_scope("layers"):
      x, (keys, values, outs) = jax.lax.scan(
          body, x, jnp.arange(first, stop, dtype=jnp.int32))
    chosen = {i: outs[i - first] for i in hidden_layers
              if first <= i < stop}
    return x, keys, values, chosen

  def _scanned(self, x, cache, positions, masks, chunk_slots, first,
               stop, hidden_layers, cache_is_empty):
    """Layers first..stop-1 from stacked [L, ...] parameters, as one
    `lax.scan` over groups of P layers (`stacking.layer_period`: P = 1
    unless windows or ropes alternate), each step indexing its layers'
    slices of the stacked weights; layers outside whole groups (a range
    that starts or ends inside one) run unrolled.

    Same arguments and results as `_unrolled`.
    """
    c = self.config
    stacked = self.variables["params"][stacking.KEY]
    period = stacking.layer_period(
        lambda i: (c.layer_window(i), c.layer_rope(i)), c.num_layers)
    blocks = [Block(c, self.param_dtype, self.plan, layer=j, parent=None)
              for j in range(period)]

    def layer(x, i, j):
      """Layer i (an int or traced), whose code is that of layer j < P."""
      cache_m, chunk_m, start = masks[c.layer_window(j)]
      if cache_is_empty:
        k_cache = v_cache = None
      else:
        k_cache, v_cache = cache.k[i], cache.v[i]
        if start is not None:
          window = c.layer_window(j)
          k_cache = window_slots(k_cache, start, window)
          v_cache = window_slots(v_cache, start, window)
      params = stacking.take_layer(stacked, i, keep=EXPERT_PARAMS)
      # A nested apply: its experts' count (`Block._moe`) is sown again
      # here, in this module's own collection.
      (x, k, v), sown = blocks[j].apply(
          {"params": params}, x, k_cache, v_cache, positions, cache_m,
          chunk_m, chunk_slots, mutable=["intermediates"])
      return x, k, v, sum(jax.tree.leaves(sown), jnp.int32(0))

    def unrolled(x, layers):
      pieces = []
      for i in layers:
        with jax.named_scope(f"layer_{i}"):
          x, k, v, n = layer(x, i, i % period)
        pieces.append((k[None], v[None], x[None], n[None]))
      return x, pieces

    def group(x, g):
      parts = []
      for j in range(period):
        x, k, v, n = layer(x, g * period + j, j)
        parts.append((k, v, x, n))
      k, v, h, n = (jnp.stack(p) for p in zip(*parts))  # [P, ...]
      return x, (k, v, h if hidden_layers else None, n)

    # Layers [first, head) unrolled, whole groups g0..g1-1 scanned, the
    # rest unrolled.
    g0, g1 = -(-first // period), stop // period
    head = min(g0 * period, stop)
    x, pieces = unrolled(x, range(first, head))
    if g1 > g0:
      with jax.named_scope("layers"):
        x, (k, v, h, n) = jax.lax.scan(
            group, x, jnp.arange(g0, g1, dtype=jnp.int32))  # [G, P, ...]
      flat = lambda a: a.reshape(-1, *a.shape[2:])  # [G * P, ...]
      pieces.append((flat(k), flat(v), flat(h) if hidden_layers else None,
                     flat(n)))
    x, tail = unrolled(x, range(g1 * period if g1 > g0 else head, stop))
    ks, vs, hs, ns = zip(*(pieces + tail))
    if c.num_experts:
      self.sow("intermediates", "experts", jnp.sum(jnp.concatenate(ns)))
    chosen = {}
    if hidden_layers:
      outs = jnp.concatenate(hs)  # [l, B, T, E]
      chosen = {i: outs[i - first] for i in hidden_layers
                if first <= i < stop}
    return x, jnp.concatenate(ks), jnp.concatenate(vs), chosen

  def logits(self, hidden: jax.Array) -> jax.Array:
    """[..., E] -> [..., V] float32 (soft-capped if the config says so)."""
    if self.config.tie_embeddings:
      # The embedding [V, E] is always stored [out, in] for this product.
      head, plan = self.embed, dataclasses.replace(self.plan, layout="out_in")
    else:
      head, plan = self.lm_head, self.plan
    return softcap(project(hidden, head, plan, out_dtype=jnp.float32),
                   self.config.final_logit_softcap)
