"""Llama- and Gemma-family models: `ModelConfig`, the Flax `Transformer`,
and `Model`.

Shape letters (`specjax.shapes`): B batch, T chunk, P padded prompt, S cache
size, E hidden, V vocab.

`Model` is the handle loaders return and decoders take: a pytree whose leaves
are the parameters and whose static part is the config, so it can be passed
straight into `jax.jit`. Decoders only use the `LanguageModel` protocol
(`specjax.models.protocol`), so any model (a fake with fixed logits, another
Flax model with its own cache) can be verified or drafted with by implementing
three methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as cache_lib
from specjax import hardware
from specjax.models import quantized
from specjax.models.config import ARCHITECTURES
from specjax.models.config import check_params
from specjax.models.config import flatten
from specjax.models.config import LinearRopeScaling
from specjax.models.config import matrix_paths
from specjax.models.config import unflatten
from specjax.models.config import ModelConfig
from specjax.models.config import param_shapes
from specjax.models.config import RopeScaling
from specjax.models.decoder import Decoder
from specjax.models.kernel import MatmulKernel
from specjax.models.matmul import MatmulPlan
from specjax.models import moe
from specjax.models.protocol import array_bytes
from specjax.models.protocol import CostGeometry
from specjax.models.protocol import declared
from specjax.models.protocol import DeclaredModel
from specjax.models.protocol import LanguageModel
from specjax.models.protocol import ModelOutput
from specjax.models.protocol import model_output
from specjax.models.protocol import supports_compaction
from specjax.models.quantized import is_quantized
from specjax.models.quantized import QuantizedMatrix
from specjax.models.quantized import quantize_params
from specjax.models.quantized import QuantSpec
from specjax.models import stacking
from specjax.models.subset import LayerSubset
from specjax.models.transformer import Transformer
from specjax.models.transformer import TransformerOutput

__all__ = [
    "ARCHITECTURES", "CostGeometry", "DeclaredModel", "Decoder",
    "LanguageModel", "LayerSubset", "LinearRopeScaling", "MatmulKernel",
    "MatmulPlan", "Model", "ModelConfig",
    "ModelOutput", "QuantSpec", "QuantizedMatrix", "RopeScaling",
    "Transformer", "TransformerOutput", "check_params", "declared",
    "is_quantized", "init_random", "matrix_paths", "model_output",
    "param_shapes",
    "supports_compaction",
]


@flax.struct.dataclass
class Model(Decoder, DeclaredModel):
  """A specjax transformer: static config plus a parameter pytree.

  Attributes:
    config: the hyper-parameters (static under jit).
    params: pytree laid out as `param_shapes(config)`, with the projection
      matrices transposed to [out, in] when `plan.layout` is "out_in".
    plan: how matrix products are computed (static; see `with_plan`).
    mesh: the device mesh its parameters are placed on
      (`specjax.sharding.shard`), or None for one device. Static: its
      caches are laid out on it (`KVCache.shard`), and decoders read it.
  """

  config: ModelConfig = flax.struct.field(pytree_node=False)
  params: Any
  plan: MatmulPlan = flax.struct.field(pytree_node=False,
                                       default=MatmulPlan())
  mesh: jax.sharding.Mesh | None = flax.struct.field(pytree_node=False,
                                                     default=None)

  # `__call__(..., write_cache=False)` returns the chunk's keys and values
  # instead of writing them (`ModelOutput.keys`; `DeclaredModel`).
  defers_cache_writes = True

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def dtype(self) -> jnp.dtype:
    return self.params["embed"].dtype

  @property
  def weight_bytes_per_token(self) -> int:
    """Parameter bytes one decode step reads: all of them, except that the
    input embedding is only gathered (T rows) when a separate `lm_head`
    exists, and a mixture of experts reads only its token's k of X
    experts per layer (`moe.inactive_expert_bytes`). Divided by memory
    bandwidth, the decode roofline. From shapes and dtypes, so
    `jax.ShapeDtypeStruct` parameters count too."""
    total = sum(map(array_bytes, jax.tree.leaves(self.params)))
    # (A quantized matrix counts its packed arrays: they are the leaves.)
    if "lm_head" in self.params:  # (packed leaves, for a quantized one)
      total -= sum(map(array_bytes, jax.tree.leaves(self.params["embed"])))
    return total - moe.inactive_expert_bytes(self.config, self.params)

  def cost_geometry(self) -> CostGeometry:
    """Every layer's attention over its cache, and the parameters one
    decode step reads (`weight_bytes_per_token`), at the first
    parameter's width (`DeclaredModel`)."""
    c = self.config
    first = jax.tree.leaves(self.params)[0]
    return CostGeometry(
        weight_bytes=float(self.weight_bytes_per_token),
        itemsize=np.dtype(first.dtype).itemsize, layers=c.num_layers,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        key=CostGeometry.identity(c, self.dtype, self.plan.name),
        num_experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
        expert_bytes=moe.expert_bytes(c, self.params))

  def for_branches(self, rows: int) -> "Model":
    """With the packed output head dequantised once (`quantized.
    with_dense`) where a pass of `rows` rows multiplies it outside the
    kernel (more than the plan's `kernel_max_rows`, float activations):
    XLA hoists that dequantisation out of a generation's loop, not out of
    an adaptive step's width branches, which otherwise each paid it
    (BENCHMARKS.md, "Never slower"). Products of fewer rows still read
    the packed rows."""
    name = "embed" if self.config.tie_embeddings else "lm_head"
    head = self.params.get(name)
    if (not quantized.is_quantized(head) or head.act_bits
        or head.dense is not None or rows <= self.plan.kernel_max_rows):
      return self
    return self.replace(params={**self.params,
                                name: quantized.with_dense(head)})

  @property
  def module(self) -> Transformer:
    return Transformer(self.config, param_dtype=self.dtype, plan=self.plan)

  def with_plan(self, plan: MatmulPlan | str, *,
                donate: bool = False) -> "Model":
    """The same model computing its products as `plan` says (a name is
    `MatmulPlan.parse`d: a kernel plan's needs its library,
    `specjax.cpu.plan(name)`).

    Switching between the "in_out" and "out_in" layouts transposes each
    projection matrix once. With `donate`, each old matrix is freed as its
    copy is made (this model is unusable afterwards), so the peak is the
    model plus its largest matrix; loaders do this.
    """
    if isinstance(plan, str):
      plan = MatmulPlan.parse(plan)
    # Int8 activations keep their row-invariant attention on any plan.
    plan = dataclasses.replace(
        plan, row_invariant=plan.row_invariant or self.plan.row_invariant)
    params = self.canonical_params()
    if plan.transposed != self.plan.transposed:
      flat = flatten(params)
      for path in matrix_paths(self.config):
        if is_quantized(flat[path]):
          continue  # always [O, I], whatever the plan
        flat[path] = (_transpose_donated if donate else _transpose)(
            flat[path])
      params = unflatten(self.config, lambda path, _: flat[path])
    if plan.scan_layers:
      params = stacking.stack_layers(params, self.config.num_layers,
                                     donate=donate)
    return self.replace(params=params, plan=plan)

  def canonical_params(self) -> Any:
    """The parameters with one dict per layer (`param_shapes`'s tree),
    unstacked if the plan scans them (matrices stay in the plan's
    layout)."""
    if stacking.is_stacked(self.params):
      return stacking.unstack_layers(self.params, self.config.num_layers)
    return self.params

  @property
  def quantization(self) -> str | None:
    """The formats of its quantized matrices ("q4_k+q6_k", "int8"), or None
    for a float model."""
    fmts = sorted({w.fmt for w in jax.tree.leaves(
        self.params, is_leaf=is_quantized) if is_quantized(w)})
    return "+".join(fmts) or None

  def quantize(self, spec: QuantSpec | str, *,
               donate: bool = False) -> "Model":
    """The same model with every matrix weight-only quantized ("int8",
    "int4", "int4:g64:sym"; `quantize_params`); norms and biases stay.
    A ":a8" suffix ("int4:a8") also quantizes the activations
    (`with_activations`)."""
    if self.mesh is not None:
      raise ValueError("Cannot quantize a model placed on a mesh: "
                       "quantized matrices are not sharded.")
    spec, act_bits = quantized.split_activations(spec)
    params = quantize_params(
        self.config, self.canonical_params(), spec,
        out_in=self.plan.transposed, donate=donate)
    if self.plan.scan_layers:
      params = stacking.stack_layers(params, self.config.num_layers)
    model = self.replace(params=params)
    return model.with_activations(act_bits) if act_bits else model

  def dequantized(self) -> "Model":
    """The float model holding the values its quantized matrices
    dequantise to (`quantized.dequantize_params`), on the same plan: the
    reference a quantized model's products are checked against."""
    params = quantized.dequantize_params(
        self.config, self.canonical_params(), out_in=self.plan.transposed)
    if self.plan.scan_layers:
      params = stacking.stack_layers(params, self.config.num_layers)
    return self.replace(params=params)

  @property
  def int8_activations(self) -> bool:
    """Whether its products quantize activations to int8
    (`with_activations`)."""
    return any(quantized.is_quantized(w) and w.act_bits == 8
               for w in jax.tree.leaves(self.params, is_leaf=is_quantized))

  @property
  def int8_rounding(self) -> bool:
    """Whether speculation on it is exact only up to rounding: int8
    activations computed where a row of a verification pass may round
    differently from the same row alone, so that an int8 code, and the
    greedy output after it, may change at a near-tie (XLA's products, or
    attention over all rows at once). On a kernel plan every int8 product
    is the kernel's, row-invariant, and `with_activations` makes attention
    row-invariant too (`MatmulPlan.row_invariant`): with every layer
    matrix quantized, a pass's rows reproduce decode steps bit for bit
    (`quantized` module docstring)."""
    kernel = self.plan.kernel
    int8 = [w for w in jax.tree.leaves(self.params, is_leaf=is_quantized)
            if quantized.is_quantized(w) and w.act_bits == 8]
    return bool(int8) and not (kernel and self.plan.row_invariant and all(
        kernel.supports(w) for w in int8))

  def with_activations(self, bits: int) -> "Model":
    """The same quantized weights multiplying int8 activations (bits 8:
    each row quantized per chunk of 64 inputs, integer dot products, as
    llama.cpp computes; `quantized.quantize_activations`) or float ones
    (0). Bits 8 also make attention row-invariant
    (`MatmulPlan.row_invariant`), so that on a kernel plan speculation
    stays exact (`int8_rounding`).

    Raises:
      ValueError: the model has no quantized matrix, or bits not 0 or 8.
    """
    return self.replace(
        params=quantized.with_activations(self.params, bits),
        plan=dataclasses.replace(self.plan, row_invariant=bits == 8))

  def init_cache(self, batch: int, size: int) -> cache_lib.KVCache:
    c = self.config
    return cache_lib.KVCache.zeros(
        num_layers=c.num_layers, batch=batch, size=size,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=self.dtype).shard(self.mesh)

  def forward(self, tokens: jax.Array | None, cache: cache_lib.KVCache,
              **kwargs) -> TransformerOutput:
    """The full pass (`Transformer.__call__`, every keyword there):
    hidden states, residual stream, chosen layers' outputs and the cache;
    for a mixture of experts also the distinct experts it woke
    (`TransformerOutput.experts`)."""
    variables = {"params": self.params}
    if not self.config.num_experts:
      return self.module.apply(variables, tokens, cache, **kwargs)
    out, sown = self.module.apply(variables, tokens, cache,
                                  mutable=["intermediates"], **kwargs)
    return out.replace(experts=sum(jax.tree.leaves(sown), jnp.int32(0)))

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> logits [..., V] float32."""
    return self.module.apply({"params": self.params}, hidden,
                             method=Transformer.logits)


_transpose = jax.jit(jnp.transpose)
_transpose_donated = jax.jit(jnp.transpose, donate_argnums=0)


def init_random(config: ModelConfig, key: jax.Array,
                dtype: jnp.dtype | str = jnp.float32) -> Model:
  """A model with freshly initialised (random) parameters (`dtype` "auto":
  `hardware.default_dtype()`, bf16 on GPU/TPU, fp32 on CPU)."""
  dtype = hardware.resolve_dtype(dtype)
  module = Transformer(config, param_dtype=dtype)
  cache = cache_lib.KVCache.zeros(
      num_layers=config.num_layers, batch=1, size=1,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)
  params = jax.jit(module.init)(key, jnp.zeros((1, 1), jnp.int32),
                                cache)["params"]
  return Model(config=config, params=params).with_plan(
      MatmulPlan.for_backend())
