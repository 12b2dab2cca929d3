"""The accelerator layout: every layer's parameters stacked [L, ...].

Shape letters (`specjax.shapes`): L layers, P layers per scanned group.

Checkpoints and `param_shapes` hold one dict per layer (`layers_{i}`). On
GPU and TPU a model stores them stacked instead, `params["layers"]` =
`{name: [L, ...]}`, and `Transformer` runs its layers as one `lax.scan`
(`MatmulPlan.scan_layers`), as MaxText's `scan_layers` does: a program then
holds one layer's code per forward instead of L, and XLA reads the
layer's slice of each stacked weight where it lies. Layers whose window
or rope differ (Gemma 3's five local layers to one global) are scanned in
groups of `layer_period` layers. The CPU keeps per-layer dicts: there XLA's
dot copies a sliced matrix first (`param_shapes`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specjax.models import moe

__all__ = ["KEY", "is_stacked", "layer_period", "stack_layers", "take_layer",
           "unstack_layers"]

# The params key of the stacked layers.
KEY = "layers"


def is_stacked(params: Any) -> bool:
  """Whether a params dict holds its layers stacked under `KEY`."""
  return isinstance(params, dict) and KEY in params


def _stack_leaves(ws: Sequence[Any]) -> Any:
  """One parameter of every layer (arrays, or `QuantizedMatrix`es of one
  format) -> the same pytree with leaves [L, ...]."""
  try:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *ws)
  except ValueError as e:
    raise ValueError(
        "Cannot stack the layers: a parameter differs in structure between "
        "layers (e.g. GGUF blocks of several formats). Keep per-layer dicts "
        "(a plan with scan_layers=False).") from e


def stack_layers(params: dict[str, Any], num_layers: int,
                 combine: Callable[[list[Any]], Any] = _stack_leaves,
                 donate: bool = False) -> dict[str, Any]:
  """`layers_0` .. `layers_{L-1}` dicts -> one `layers` dict of [L, ...].

  Args:
    params: a params (or partition-spec) tree with per-layer dicts.
    num_layers: L.
    combine: turns the L values of one parameter into its stacked value
      (default: stack the arrays, leaf by leaf).
    donate: delete each per-layer array once stacked (the caller's params
      are unusable afterwards), so the peak is the model plus one
      parameter's stack.

  Returns:
    The same tree with the layers stacked under `KEY`.
  """
  out = {k: v for k, v in params.items() if not k.startswith("layers_")}
  layers = [params[f"layers_{i}"] for i in range(num_layers)]
  stacked = {}
  for name in layers[0]:
    ws = [p[name] for p in layers]
    stacked[name] = combine(ws)
    if donate:
      for leaf in jax.tree.leaves(ws):
        if isinstance(leaf, jax.Array):
          leaf.delete()
  out[KEY] = stacked
  return out


def unstack_layers(params: dict[str, Any], num_layers: int
                   ) -> dict[str, Any]:
  """The inverse of `stack_layers`: per-layer dicts again."""
  out = {k: v for k, v in params.items() if k != KEY}
  for i in range(num_layers):
    out[f"layers_{i}"] = take_layer(params[KEY], i)
  return out


def take_layer(stacked: dict[str, Any], index: int | jax.Array,
               keep: tuple[str, ...] = ()) -> dict[str, Any]:
  """Layer `index` (an int, or a traced scalar inside a scan) of a stacked
  layers dict: every leaf [L, ...] -> [...], except the arrays named in
  `keep`, handed over unsliced as `moe.Stacked(array, index)` (a mixture
  of experts' stacks, read one expert at a time)."""
  return {name: moe.Stacked(w, jnp.asarray(index, jnp.int32))
          if name in keep else jax.tree.map(lambda a: a[index], w)
          for name, w in stacked.items()}


def layer_period(signature: Callable[[int], Any], num_layers: int) -> int:
  """P, the fewest layers after which `signature(layer)` (what a layer's
  code depends on: its window and rope) repeats: 1 for Llama or Qwen, 6
  for Gemma 3's five local layers and one global."""
  for period in range(1, num_layers + 1):
    if all(signature(i) == signature(i % period)
           for i in range(num_layers)):
      return period
  return num_layers
