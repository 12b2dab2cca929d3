"""Sparse upcycling (Komatsuzaki et al. 2022): a dense model's MLP becomes
X experts, to measure mixtures of experts on where no trained one ships.

Shape letters (`specjax.shapes`): E hidden size, F MLP size, X experts, k
experts per token.

`upcycle` copies every layer's gated MLP into X experts, each perturbed by
seeded Gaussian noise of `noise` times the matrix's own standard
deviation, and adds a router of seeded N(0, `router_std`) weights. With
`norm_topk_prob` the k chosen experts' weights sum to one, so the model
still writes the dense model's text, while its experts differ: which ones
a pass wakes, and so what it reads, depends on its tokens as in a trained
mixture. It is an upcycled model, not a trained one: its routing carries
no specialisation, and every figure measured on it says so.

With `quantize` each expert is weight-only quantized as soon as it is
made (`quantized.quantize_array`, stacked per layer), so that a model
whose float experts would not fit in memory (the 1.5B's 8 copies need 37
GB in float32) is built at the size of its packed experts.

`active_twin` is the dense model with the same active parameters per
token: k experts side by side as one MLP of k·F (down scaled by 1/k), the
baseline a mixture of experts' costs are compared with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import Model
from specjax.models import quantized
from specjax.models.config import check_params
from specjax.models.config import experts_out_in

__all__ = ["active_twin", "upcycle"]

# Qwen2-MoE's field names and routing (`norm_topk_prob`, weights cast to the
# activations' dtype): the dense Qwen2 and Llama families keep their
# attention as it is.
_ARCH = "qwen2_moe"


def upcycle(model: Model, num_experts: int, top_k: int, *,
            noise: float = 0.01, router_std: float = 0.02,
            seed: int = 0, quantize: str | None = None) -> Model:
  """The dense `model` as a mixture of `num_experts` experts, `top_k` per
  token (renormalised), every other parameter shared.

  Args:
    model: a dense float model with per-layer [in, out] matrices
      ("in_out/xla").
    num_experts: X.
    top_k: k, in [1, X].
    noise: each expert is its dense matrix plus N(0, (noise · std)^2)
      noise, std the matrix's own; 0 makes every expert the dense MLP.
    router_std: the router's seeded weights are N(0, router_std^2).
    seed: the noise's and the router's seed.
    quantize: None (float experts), or a weight-only format for the
      experts alone ("int8", "int4", `quantized.QuantSpec.parse`): each
      quantized once made. The same seed draws the same noise either way.

  Returns:
    A `Model` of arch "qwen2_moe" on the "in_out/xla" plan.

  Raises:
    ValueError: a mixture of experts already, another plan, or k not in
      [1, X].
  """
  c = model.config
  if c.num_experts:
    raise ValueError(f"upcycle takes a dense model; this one already has "
                     f"{c.num_experts} experts.")
  if model.plan.transposed or model.plan.scan_layers:
    raise ValueError(f"upcycle reads [in, out] per-layer matrices; this "
                     f"model's plan is {model.plan.name!r}: pass "
                     f"model.with_plan('in_out/xla').")
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k must be in [1, num_experts={num_experts}], "
                     f"got {top_k}.")
  config = c.replace(arch=_ARCH, num_experts=num_experts,
                     num_experts_per_tok=top_k, norm_topk_prob=True,
                     router_weights_float32=False)
  spec = None if quantize is None else quantized.QuantSpec.parse(quantize)
  rng = np.random.default_rng(seed)
  dtype = np.dtype(model.dtype)

  def expert(w, name):
    """One perturbed copy of w [F, E] (F-major), kept as the stack holds
    it: float, or packed as the [out, in] matrix it is."""
    scale = noise * float(w.std())
    e = w + rng.normal(0.0, scale, w.shape).astype(np.float32) if scale else w
    if spec is None:
      return e.astype(dtype)
    param = f"experts_{name}"
    return quantized.quantize_array(experts_out_in(e, param), spec, param,
                                    dtype=dtype)

  params = dict(model.params)  # per-layer (checked above)
  for i in range(c.num_layers):
    layer = params[f"layers_{i}"]
    out = {k: v for k, v in layer.items() if k not in ("gate", "up", "down")}
    out["router"] = jnp.asarray(rng.normal(
        0.0, router_std, (c.hidden_size, num_experts)).astype(model.dtype))
    # Every expert F-major, [X, F, E] (`specjax.models.moe`): gate and up
    # transposed from [E, F], down as it is.
    for name, w in (("gate", layer["gate"].T), ("up", layer["up"].T),
                    ("down", layer["down"])):
      w = np.asarray(w, np.float32)
      copies = [expert(w, name) for _ in range(num_experts)]
      stacked = (np.stack(copies) if spec is None else quantized.stack(
          copies, shape=(num_experts, *w.shape)))
      out[f"experts_{name}"] = jax.tree.map(jnp.asarray, stacked)
    params[f"layers_{i}"] = out
  check_params(config, params)
  return Model(config=config, params=params)


def active_twin(moe_model: Model) -> Model:
  """The dense model with `moe_model`'s active parameters per token: in
  each layer the first k experts side by side, one MLP of k·F (gate and
  up [E, kF], down [kF, E] scaled by 1/k); attention, norms and
  embeddings shared.

  Raises:
    ValueError: `moe_model` is dense, quantized, or not on a per-layer
      plan.
  """
  c = moe_model.config
  if not c.num_experts or moe_model.plan.scan_layers:
    raise ValueError("active_twin takes a mixture of experts with "
                     "per-layer parameters.")
  if any(quantized.is_quantized(w) for w in jax.tree.leaves(
      moe_model.params, is_leaf=quantized.is_quantized)):
    raise ValueError("active_twin takes float experts; this mixture of "
                     "experts is quantized (upcycle it with quantize=None).")
  k = c.num_experts_per_tok
  config = c.replace(arch="qwen2", intermediate_size=k * c.intermediate_size,
                     num_experts=0, num_experts_per_tok=0,
                     norm_topk_prob=False, shared_expert_size=0)
  params = {}
  for name, value in moe_model.canonical_params().items():
    if not name.startswith("layers_"):
      params[name] = value
      continue
    layer = {n: v for n, v in value.items()
             if n != "router" and not n.startswith("experts_")}
    layer["gate"] = jnp.concatenate(value["experts_gate"][:k], 0).T
    layer["up"] = jnp.concatenate(value["experts_up"][:k], 0).T
    layer["down"] = jnp.concatenate(value["experts_down"][:k], 0) / k
    params[name] = layer
  check_params(config, params)
  return Model(config=config, params=params)
