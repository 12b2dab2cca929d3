"""Mixture-of-experts MLPs: top-k routing and the products of the chosen
experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), as `Block` runs them when
`ModelConfig.num_experts` > 0.

Shape letters (`specjax.shapes`): N token rows (B·T), E hidden size, F
expert MLP size, X experts, k experts per token, M = N·k (token, slot)
pairs.

Experts are stacked F-major, [X, F, E] all three (gate and up [X, out,
in], down [X, in, out]), whatever the plan: sharded over F (the
`sharding.rules`), a TPU shard keeps F off the minor dimension, where a
shard narrower than a tile (Qwen3's F = 768 over 8 chips: 96 columns)
made XLA relay out the whole stack every step; a CPU kernel plan
multiplies expert j where it lies in the stack (`MatmulKernel.pick`, down
`in_out`). Quantized (`Model.quantize`, a GGUF file's blocks kept), each
expert is packed as the [out, in] matrix it is, one `QuantizedMatrix` per
stack (down packed [X, E, F]); a pass dequantises only the experts it
reads, or the kernel reads their packed rows in place.

Routing follows transformers' `*TopKRouter`s in order and dtype: router
logits in the activations' dtype, softmax in float32 over all X experts,
top-k of the probabilities, then (with `norm_topk_prob`) division by their
sum; Qwen-MoE and OLMoE cast the weights to the activations' dtype,
Mixtral keeps them in float32.

Decode and verification read only the experts their tokens chose:
`experts_loop` runs a loop over the distinct chosen experts (a dynamic
trip count), reading each once, and `experts_grouped` runs each only on
the rows that chose it, in tiles. `strategy` picks per backend and size
among them, gathering each pair's expert (`experts_gather`), every expert
densely (`experts_dense`, prefill only) and the grouped matmul
`jax.lax.ragged_dot` over tokens sorted by expert (`experts_ragged`; XLA's
CPU lowering expands it to every group's masked product), as
`scripts/bench_moe.py` measured them. Every strategy computes the same
function: only float rounding differs.

`fewer_experts` is the target as its own draft: the same parameter arrays
routing each token to fewer experts (top-1 instead of top-2), a cheaper
model with the target's vocabulary and no training.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import quantized
from specjax.models.config import EXPERT_PARAMS
from specjax.models.config import experts_out_in
from specjax.models.config import flatten
from specjax.models.config import ModelConfig
from specjax.models.protocol import array_bytes

__all__ = ["Experts", "STRATEGIES", "Stacked", "activate", "apply_experts",
           "experts_dense", "experts_gather", "experts_grouped",
           "experts_ragged", "expert_bytes", "fewer_experts",
           "inactive_expert_bytes", "route", "strategy", "count_distinct"]

STRATEGIES = ("loop", "grouped", "gather", "dense", "ragged")
# On GPU and TPU, chunks of at most this many token rows loop over their
# distinct experts: a decode step (B rows), a verification pass (B·(γ+1))
# or a token tree. Longer chunks are prefill (`strategy`).
LOOP_MAX_ROWS = 128
# Rows per product of `experts_grouped`.
GROUP_TILE = 16


@flax.struct.dataclass
class Stacked:
  """Layer `index` of a stacked [L, X, ...] expert array, not sliced: a
  scanned layer (`Transformer._scanned`) hands its experts over this way,
  so that a pass reads only the experts it picks (`Experts.product`) instead
  of copying the layer's whole [X, ...] stack out of the [L, ...] one.

  Attributes:
    array: [L, X, ...] every layer's experts.
    index: [] int32 the layer.
  """

  array: jax.Array
  index: jax.Array


@flax.struct.dataclass
class Experts:
  """One layer's experts, stacked.

  Attributes:
    gate: [X, F, E] gate projections, [X, out, in] ([L, X, F, E] with
      `layer`).
    up: [X, F, E] up projections (likewise).
    down: [X, F, E] down projections, [X, in, out] (likewise).
    layer: [] int32, the layer of [L, ...] arrays, or None.
  Each may instead be a `QuantizedMatrix` stack of shape [X, F, E]
  (packed [X, out, in]: down [X, E, F]).
  """

  gate: jax.Array
  up: jax.Array
  down: jax.Array
  layer: jax.Array | None = None

  @classmethod
  def of(cls, gate: Any, up: Any, down: Any) -> "Experts":
    """A layer's three parameters: arrays, or `Stacked` layers of them."""
    if isinstance(gate, Stacked):
      return cls(gate.array, up.array, down.array, layer=gate.index)
    return cls(gate, up, down)

  def product(self, h: jax.Array, name: str, j: jax.Array,
              kernel: Any = None) -> jax.Array:
    """h [N, I] times expert j's `name` ("gate", "up" or "down") matrix
    -> [N, O] in h's dtype, accumulated in float32: in `kernel` (a
    `MatmulKernel`, for per-layer stacks it `reads`), which reads the
    matrix where it lies, else XLA's dot of the slice (the one expert
    read; a quantized one dequantised, `quantized.matmul`)."""
    w = getattr(self, name)
    # A quantized down is packed [X, out, in], as every packed matrix.
    in_out = name == "down" and not quantized.is_quantized(w)
    if kernel is not None:
      return kernel.pick(h.astype(jnp.float32), j, w,
                         in_out=in_out).astype(h.dtype)
    index = (j,) if self.layer is None else (self.layer, j)
    if quantized.is_quantized(w):
      return quantized.matmul(h, quantized.select(w, *index))
    return _dot(h, w[index], "ni,io->no" if in_out else "ni,oi->no")

  def reads(self, kernel: Any, dtype: Any) -> bool:
    """Whether `kernel` (a `MatmulKernel`, or None) can multiply
    activations of `dtype` by these experts where they lie: float32
    activations, per-layer stacks, float32 or packed in a format it
    supports."""
    return (kernel is not None and self.layer is None
            and dtype == jnp.float32
            and all(kernel.supports(w) if quantized.is_quantized(w)
                    else w.dtype == jnp.float32
                    for w in (self.gate, self.up, self.down)))

  @property
  def count(self) -> int:
    """X."""
    if quantized.is_quantized(self.gate):
      return self.gate.shape[0]  # the logical [X, F, E]
    return self.gate.shape[0 if self.layer is None else 1]

  def whole(self) -> "Experts":
    """The layer's float [X, F, E] stacks: a copy out of [L, ...] ones,
    quantized ones dequantised (to their `dtype`)."""
    def full(w, name):
      if self.layer is not None:
        w = jax.tree.map(lambda a: a[self.layer], w)
      if not quantized.is_quantized(w):
        return w
      d = quantized.dequantize(w).astype(w.dtype)  # [X, out, in]
      return experts_out_in(d, f"experts_{name}")
    if self.layer is None and not any(
        map(quantized.is_quantized, (self.gate, self.up, self.down))):
      return self
    return Experts(full(self.gate, "gate"), full(self.up, "up"),
                   full(self.down, "down"))


def route(logits: jax.Array, top_k: int, normalize: bool
          ) -> tuple[jax.Array, jax.Array]:
  """Top-k routing as transformers' routers do it.

  Args:
    logits: [N, X] router logits, any float dtype.
    top_k: k (static).
    normalize: divide the k probabilities by their sum
      (`norm_topk_prob`).

  Returns:
    weights [N, k] float32 (descending) and experts [N, k] int32.
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, X]
  weights, experts = jax.lax.top_k(probs, top_k)  # [N, k]
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts.astype(jnp.int32)


def activate(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
  """[..., F] gate and up -> act(gate) * up, the gated MLP's product
  (`ModelConfig.activation`: GeGLU for "gelu_tanh", else SwiGLU)."""
  if activation == "gelu_tanh":
    return jax.nn.gelu(gate, approximate=True) * up
  return jax.nn.silu(gate) * up


def _dot(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
  """einsum `spec` accumulated in float32, cast back to x's dtype."""
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32
                    ).astype(x.dtype)


def experts_gather(x: jax.Array, experts: jax.Array, ws: Experts,
                   activation: str) -> jax.Array:
  """Each (token, slot) pair through its own expert, whose matrices are
  gathered: M expert reads, never the X - (distinct chosen) others.

  Args:
    x: [N, E] token rows.
    experts: [N, k] int32 chosen experts.
    ws: the layer's experts.
    activation: the gated MLP's activation (`ModelConfig.activation`).

  Returns:
    [N, k, E] each pair's expert output, unweighted, in x's dtype.
  """
  n, k = experts.shape
  flat = experts.reshape(n * k)  # [M]
  rows = jnp.repeat(x, k, axis=0)  # [M, E]
  gate = _dot(rows, ws.gate[flat], "me,mfe->mf")  # [M, F]
  up = _dot(rows, ws.up[flat], "me,mfe->mf")
  out = _dot(activate(gate, up, activation), ws.down[flat],
             "mf,mfe->me")  # [M, E]
  return out.reshape(n, k, -1)


def experts_loop(x: jax.Array, experts: jax.Array, weights: jax.Array,
                 ws: Experts, activation: str, kernel: Any = None
                 ) -> jax.Array:
  """A loop over the distinct experts the chunk chose (a dynamic trip
  count), each run on all N rows and added with its rows' routing weight
  (zero for rows that did not choose it), in expert order as transformers
  adds them: reads each active expert once and no other.

  Args:
    x: [N, E] token rows.
    experts: [N, k] int32 chosen experts.
    weights: [N, k] their routing weights.
    ws: the layer's experts.
    activation: the gated MLP's activation.
    kernel: a `MatmulKernel` multiplying the experts in place
      (`Experts.product`), or None for XLA's dots.

  Returns:
    [N, E] the weighted sum, in x's dtype.
  """
  num = ws.count
  chosen = distinct_experts(experts, num)  # [min(M, X)], X-padded
  count = jnp.sum(chosen < num)

  def body(state):
    i, out = state
    j = chosen[i]
    coef = jnp.sum(jnp.where(experts == j, weights, 0), axis=1)  # [N]
    y = _expert(x, j, ws, activation, kernel)  # [N, E]
    return i + 1, out + (y * coef[:, None]).astype(x.dtype)

  _, out = jax.lax.while_loop(lambda s: s[0] < count, body,
                              (jnp.int32(0), jnp.zeros_like(x)))
  return out


def experts_grouped(x: jax.Array, experts: jax.Array, weights: jax.Array,
                    ws: Experts, activation: str, kernel: Any = None,
                    tile: int | None = None) -> jax.Array:
  """`experts_loop`, each expert run only on the rows that chose it,
  `tile` rows at a time (a dynamic trip count per expert): the (token,
  slot) pairs sorted by expert, each tile's rows gathered, multiplied,
  and added back weighted. An expert chosen by n of the N rows multiplies
  ⌈n / tile⌉ · tile rows instead of N (about N·k/X each in a prefill
  chunk); the sums are added in expert order as the loop adds them.

  Same arguments and result as `experts_loop`; `tile` defaults to
  `GROUP_TILE`.
  """
  tile = tile or GROUP_TILE
  n, k = experts.shape
  num = ws.count
  flat = experts.reshape(n * k)  # [M]
  order = jnp.argsort(flat, stable=True)  # [M]
  tokens = order // k  # [M] each sorted pair's row
  coefs = weights.reshape(n * k)[order]  # [M]
  sizes = jnp.bincount(flat, length=num).astype(jnp.int32)  # [X]
  starts = jnp.cumsum(sizes) - sizes  # [X]
  chosen = distinct_experts(experts, num)
  count = jnp.sum(chosen < num)
  slots = jnp.arange(tile)  # [T]

  def expert(state):
    i, out = state
    j = chosen[i]

    def part(state):
      t, out = state
      at = starts[j] + t * tile + slots  # [T]
      valid = at < starts[j] + sizes[j]
      at = jnp.minimum(at, n * k - 1)
      rows = tokens[at]  # [T] distinct where valid
      y = _expert(x[rows], j, ws, activation, kernel)  # [T, E]
      add = jnp.where(valid[:, None], y * coefs[at][:, None], 0)
      return t + 1, out.at[rows].add(add.astype(x.dtype))

    _, out = jax.lax.while_loop(lambda s: s[0] * tile < sizes[j], part,
                                (jnp.int32(0), out))
    return i + 1, out

  _, out = jax.lax.while_loop(lambda s: s[0] < count, expert,
                              (jnp.int32(0), jnp.zeros_like(x)))
  return out


def _expert(x: jax.Array, j: jax.Array, ws: Experts, activation: str,
            kernel: Any) -> jax.Array:
  """Expert `j`'s gated MLP of rows x [R, E] -> [R, E]."""
  gate = ws.product(x, "gate", j, kernel)  # [R, F]
  up = ws.product(x, "up", j, kernel)
  return ws.product(activate(gate, up, activation), "down", j, kernel)


def count_distinct(experts: jax.Array, num_experts: int) -> jax.Array:
  """[N, k] chosen experts -> [] int32 how many distinct ones: what a pass
  of the N rows reads."""
  chosen = jnp.zeros((num_experts,), jnp.int32)
  return jnp.sum(chosen.at[experts.reshape(-1)].max(1))


def distinct_experts(experts: jax.Array, num_experts: int) -> jax.Array:
  """[N, k] chosen experts -> the distinct ones ascending, padded with X to
  min(N·k, X) entries."""
  size = min(experts.size, num_experts)
  return jnp.unique(experts.reshape(-1), size=size, fill_value=num_experts)


def experts_dense(x: jax.Array, experts: jax.Array, ws: Experts,
                  activation: str) -> jax.Array:
  """Every expert over every token, then each pair's chosen output: reads
  each expert once, and computes X/k times the products needed (a prefill
  strategy; never for decoding).

  Same arguments and result as `experts_gather`.
  """
  gate = _dot(x, ws.gate, "ne,xfe->nxf")  # [N, X, F]
  up = _dot(x, ws.up, "ne,xfe->nxf")
  out = _dot(activate(gate, up, activation), ws.down,
             "nxf,xfe->nxe")  # [N, X, E]
  return jnp.take_along_axis(out, experts[..., None], axis=1)  # [N, k, E]


def experts_ragged(x: jax.Array, experts: jax.Array, ws: Experts,
                   activation: str) -> jax.Array:
  """Pairs sorted by expert, then one grouped matmul per projection
  (`jax.lax.ragged_dot`: each group of rows times its expert), then
  unsorted. A grouped kernel on GPU and TPU; on CPU XLA expands it to
  every group's masked product.

  Same arguments and result as `experts_gather`.
  """
  n, k = experts.shape
  num = ws.gate.shape[0]
  flat = experts.reshape(n * k)  # [M]
  order = jnp.argsort(flat, stable=True)  # [M]
  rows = jnp.repeat(x, k, axis=0)[order]  # [M, E], sorted by expert
  sizes = jnp.bincount(flat, length=num).astype(jnp.int32)  # [X]

  def grouped(a, w, contract):
    """Rows [M, I] grouped by expert times each group's matrix, whose
    input axis is `contract` (2: [X, O, I]; 1: [X, I, O])."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [contract]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(
        a, w, sizes, dims, preferred_element_type=jnp.float32
    ).astype(a.dtype)

  h = activate(grouped(rows, ws.gate, 2), grouped(rows, ws.up, 2),
               activation)
  out = grouped(h, ws.down, 1)  # [M, E], sorted
  out = jnp.zeros_like(out).at[order].set(out)  # [M, E], pair order
  return out.reshape(n, k, -1)


_LOOPS = {"loop": experts_loop, "grouped": experts_grouped}
_PAIRWISE = {"gather": experts_gather, "dense": experts_dense,
             "ragged": experts_ragged}


def strategy(rows: int, backend: str | None = None) -> str:
  """Which expert product a chunk of `rows` token rows runs (static).

  Chunks of up to `GROUP_TILE` rows (decode steps, short verification
  passes, trees) loop over their distinct experts on all N rows
  (`experts_loop`), reading only those. Longer chunks on CPU (wide
  verification passes, prefill) run each chosen expert on its own rows
  (`experts_grouped`), which `scripts/bench_moe.py` measured fastest there
  from 32 rows, with XLA's dots or the kernel (XLA's CPU `ragged_dot`
  expands to every group's masked product). On GPU and TPU, chunks of up
  to `LOOP_MAX_ROWS` loop too, and longer ones run the grouped
  `ragged_dot`, which has grouped kernels there.
  """
  backend = backend or jax.default_backend()
  if backend == "cpu":
    return "loop" if rows <= GROUP_TILE else "grouped"
  return "loop" if rows <= LOOP_MAX_ROWS else "ragged"


def apply_experts(x: jax.Array, logits: jax.Array, ws: Experts,
                  config: ModelConfig, how: str | None = None,
                  kernel: Any = None) -> jax.Array:
  """The routed experts' weighted sum for each token (without the shared
  expert).

  Args:
    x: [..., E] normalised residual stream.
    logits: [..., X] router logits.
    ws: the layer's experts.
    config: the model (k, `norm_topk_prob`, the weights' dtype, the
      activation).
    how: one of `STRATEGIES`, or None for `strategy`'s choice.
    kernel: the plan's `MatmulKernel`, or None: the loop then multiplies
      the experts in it where it can (`Experts.reads`), reading each in
      place (XLA's dot copies a sliced matrix first).

  Returns:
    [..., E] in x's dtype, and [] int32 the distinct experts the tokens
    chose (`count_distinct`: what the pass read).
  """
  lead, e = x.shape[:-1], x.shape[-1]
  rows = int(np.prod(lead, dtype=np.int64))
  x2 = x.reshape(rows, e)  # [N, E]
  weights, experts = route(logits.reshape(rows, -1),
                           config.num_experts_per_tok,
                           config.norm_topk_prob)  # [N, k]
  how = how or strategy(rows)
  if how not in STRATEGIES:
    raise ValueError(f"Unknown expert strategy {how!r}; expected one of "
                     f"{STRATEGIES}.")
  if not config.router_weights_float32:
    weights = weights.astype(x.dtype)
  if how in _LOOPS:
    out = _LOOPS[how](x2, experts, weights, ws, config.activation,
                      kernel if ws.reads(kernel, x.dtype) else None)
  else:
    out = _PAIRWISE[how](x2, experts, ws.whole(),
                         config.activation)  # [N, k, E]
    # Each expert's weighted output in x's dtype, summed over the k slots.
    out = (out * weights[..., None]).astype(x.dtype).sum(axis=1)  # [N, E]
  return out.reshape(*lead, e), count_distinct(experts, config.num_experts)


def expert_bytes(config: ModelConfig, params: Any) -> float:
  """Bytes of one expert's matrices summed over the layers in `params`
  (per-layer or stacked [L, ...] alike): what each further distinct
  expert a pass wakes in every layer costs it to read. 0 for a dense
  model."""
  if not config.num_experts:
    return 0.0
  # (A quantized stack counts its packed arrays: they are the leaves.)
  total = sum(array_bytes(a) for path, w in flatten(params).items()
              if path.rpartition("/")[2] in EXPERT_PARAMS
              for a in jax.tree.leaves(w))
  return total / config.num_experts


def inactive_expert_bytes(config: ModelConfig, params: Any) -> int:
  """Bytes of expert weights one token does not read: (X - k) / X of every
  layer's stacked experts. `Model.weight_bytes_per_token` subtracts them,
  so that a decode step is priced by its k active experts."""
  return int(expert_bytes(config, params)
             * (config.num_experts - config.num_experts_per_tok))


def fewer_experts(model: Any, k: int) -> Any:
  """The mixture of experts `model` running each token's top `k` experts
  instead of its config's k: a self-draft for `model` (fewer expert
  reads per token, no second model, no training).

  It is `model` with only `num_experts_per_tok` replaced: the same
  parameter arrays (no copy) and matmul plan, its own cost key, and, as
  the model of a `specjax.drafters.DraftModel`, a cache of its own, so
  the target's output is untouched and speculation stays exact. Routing
  stays well defined at k = 1: renormalised weights (`norm_topk_prob`,
  Mixtral) are each one exactly, unnormalised ones the top probability.

  Args:
    model: a `specjax.models.Model` with `num_experts` > 0.
    k: experts per token, in [1, the model's k).

  Returns:
    The draft `Model`, whose `weight_bytes_per_token` counts k experts
    per layer.

  Raises:
    ValueError: a dense model, or k not an integer in [1, the model's k).
  """
  c = model.config
  if not c.num_experts:
    raise ValueError(f"fewer_experts needs a mixture of experts; this "
                     f"{c.arch} model is dense (num_experts=0).")
  top = c.num_experts_per_tok
  if (isinstance(k, bool) or not isinstance(k, (int, np.integer))
      or not 1 <= k < top):
    raise ValueError(f"fewer_experts k must be an integer in [1, {top}) "
                     f"for a model routing to {top} of {c.num_experts} "
                     f"experts per token, got {k!r}.")
  return model.replace(config=c.replace(num_experts_per_tok=int(k)))
