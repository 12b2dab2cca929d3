"""The programs a user runs, compiled ahead of time from abstract weights.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size,
N_cap output width, G = γ, L layers.

Weights are `jax.ShapeDtypeStruct`s at a model's real shapes, laid out on
a mesh of compile-only devices (`chips.devices`), so nothing is loaded and
no accelerator is needed: `jax.jit(...).lower(...).compile()` returns the
executable the chip would run. `compile_program` records its trace, lower
and compile seconds, XLA's memory analysis and what its HLO reads
(`hlo.count`). The programs are the library's own jitted loops
(`specjax.loops`) and one step of each (`specjax.speculate`,
`specjax.plain`), called with the arguments `decode` would give them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from specjax import buffers
from specjax import loops
from specjax import plain
from specjax import policies
from specjax import sampling
from specjax import speculate
from specjax.aot import hlo
from specjax.models import MatmulPlan
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models import QuantizedMatrix
from specjax.models.config import matrix_paths
from specjax.models.config import unflatten
from specjax.padding import prepare_prompts
from specjax.shapes import DATA
from specjax.shapes import MODEL
from specjax.sharding import rules
from specjax.step_types import StepParams

__all__ = ["Call", "Compiled", "abstract_model", "compile_program",
           "kv_bytes", "make_mesh"]


def make_mesh(devices: list) -> Mesh:
  """A 1 x n (data x model) mesh: a tensor-parallel target."""
  return Mesh(np.asarray(devices).reshape(1, len(devices)), (DATA, MODEL))


def kv_bytes(config: ModelConfig, dtype: Any, batch: int, size: int) -> int:
  """Bytes of a KV cache of B rows and S slots."""
  return (2 * config.num_layers * batch * size * config.num_kv_heads
          * config.head_dim * np.dtype(dtype).itemsize)


def _int8(shape: tuple[int, int], path: str, dtype: Any) -> QuantizedMatrix:
  """An abstract int8 matrix as `quantized.quantize_array` makes it:
  codes [O, I] int8 and one float32 scale per row [O, 1]."""
  rows, cols = shape if path == "embed" else shape[::-1]
  return QuantizedMatrix(
      low=jax.ShapeDtypeStruct((rows, cols), jnp.int8),
      scales=jax.ShapeDtypeStruct((rows, 1), jnp.float32), fmt="int8",
      bits=8, group=cols, shape=tuple(shape), dtype=jnp.dtype(dtype))


def _quantized_spec(w: QuantizedMatrix, spec: PartitionSpec
                    ) -> QuantizedMatrix:
  """The partition of a quantized matrix whose float form stored [I, O]
  (after any leading layer axis) would be split as `spec`: codes [O, I]
  and scales [O, 1] split by rows as the matrix's O axis is."""
  *lead, i_axis, o_axis = tuple(spec) + (None,) * (
      w.low.ndim - len(tuple(spec)))
  return w.replace(low=PartitionSpec(*lead, o_axis, i_axis),
                   scales=PartitionSpec(*lead, o_axis, None))


def abstract_model(config: ModelConfig, mesh: Mesh, *,
                   dtype: Any = jnp.bfloat16, quantize: str | None = None,
                   scan: bool = True, split: bool = True) -> Model:
  """A `Model` whose parameters are `jax.ShapeDtypeStruct`s on `mesh`.

  Args:
    config: the model's shapes.
    mesh: where its parameters live (`make_mesh`).
    dtype: parameter and cache dtype.
    quantize: None, or "int8" (weight-only, per output channel, as
      `Model.quantize("int8")` stores it).
    scan: stack the layers and scan them (`MatmulPlan.scan_layers`), the
      accelerator layout; False unrolls them.
    split: split the parameters over the mesh's model axis (a target);
      False replicates them (a draft).

  Returns:
    The abstract model, placed on `mesh`.
  """
  if quantize not in (None, "int8"):
    raise ValueError(f"quantize must be None or 'int8', got {quantize!r}.")
  quantized = set(matrix_paths(config)) | {"embed"} if quantize else set()

  def leaf(path, shape):
    if path in quantized:
      return _int8(shape, path, dtype)
    return jax.ShapeDtypeStruct(shape, dtype)

  plan = MatmulPlan(scan_layers=scan)
  model = jax.eval_shape(lambda m: m.with_plan(plan),
                         Model(config=config, params=unflatten(config, leaf)))
  specs = rules.param_specs(config, mesh, plan=plan, split=split)
  is_spec = lambda x: isinstance(x, PartitionSpec)
  specs = jax.tree.map(
      lambda s, w: _quantized_spec(w, s) if isinstance(
          w, QuantizedMatrix) else s, specs, model.params,
      is_leaf=lambda x: is_spec(x) or isinstance(x, QuantizedMatrix))
  params = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=NamedSharding(mesh, s)),
      model.params, specs, is_leaf=is_spec)
  return model.replace(params=params, mesh=mesh)


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One program compiled for a chip (figures are compiled, not run).

  Attributes:
    name: what the program is.
    trace_s, lower_s, compile_s: seconds of each stage on this CPU.
    memory: XLA's `memory_analysis()`: argument, output, alias, temp and
      generated-code bytes per device.
    count: what its HLO reads and holds (`hlo.count`).
    xla_bytes: XLA's own `cost_analysis()["bytes accessed"]` (a while
      body counted once; kept to show the difference).
  """

  name: str
  trace_s: float
  lower_s: float
  compile_s: float
  memory: dict[str, int]
  count: hlo.HloCount
  xla_bytes: float

  @property
  def peak_bytes(self) -> int:
    """HBM one device holds while the program runs."""
    m = self.memory
    return (m["argument"] + m["output"] - m["alias"] + m["temp"]
            + m["generated_code"])


def compile_program(name: str, fn: Callable[..., Any], *args: Any,
                    static: dict[str, Any] | None = None,
                    donate: tuple[int, ...] = (),
                    cheapest: tuple[str, ...] = ()) -> Compiled:
  """Traces, lowers and compiles `fn(*args, **static)` (array arguments
  abstract or not: only their shapes, dtypes and shardings are used),
  donating the arguments at `donate`; `cheapest`: as `hlo.count`'s."""
  jitted = jax.jit(functools.partial(fn, **(static or {})),
                   donate_argnums=donate)
  t0 = time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  ma = compiled.memory_analysis()
  memory = {"argument": ma.argument_size_in_bytes,
            "output": ma.output_size_in_bytes,
            "alias": ma.alias_size_in_bytes,
            "temp": ma.temp_size_in_bytes,
            "generated_code": ma.generated_code_size_in_bytes}
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return Compiled(name=name, trace_s=t1 - t0, lower_s=t2 - t1,
                  compile_s=t3 - t2, memory=memory,
                  count=hlo.count(compiled.as_text(), cheapest),
                  xla_bytes=float((cost or {}).get("bytes accessed", 0.0)))


def compile_or_refusal(name: str, fn: Callable[..., Any], *args: Any,
                        **kwargs: Any) -> Compiled | str:
  """`compile_program`, or the first line of XLA's refusal of a program
  that cannot fit the chip (`RESOURCE_EXHAUSTED`): that is a result."""
  try:
    return compile_program(name, fn, *args, **kwargs)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return str(e).splitlines()[0]


def _abstract(tree: Any, mesh: Mesh) -> Any:
  """Host values -> replicated `ShapeDtypeStruct`s on `mesh`."""
  replicated = NamedSharding(mesh, PartitionSpec())

  def to(x):
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
    return x
  return jax.tree.map(to, tree)


@dataclasses.dataclass(frozen=True)
class Call:
  """One `generate` / `speculative_generate` call's arguments, as `decode`
  builds them, abstract on the target's mesh.

  Attributes:
    target: the abstract target `Model`.
    batch: B.
    prompt_len: tokens per prompt.
    max_new_tokens: N.
  """

  target: Model
  batch: int = 1
  prompt_len: int = 512
  max_new_tokens: int = 256

  def _inputs(self, reserve: int):
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 1000, (self.batch, self.prompt_len)).tolist()
    tokens, lengths, size = prepare_prompts(
        prompts, self.target.vocab_size,
        max_new_tokens=self.max_new_tokens, cache_size=None,
        reserve=reserve)
    budget = np.int32(self.max_new_tokens)
    key = sampling.host_key(0)
    return tokens, lengths, size, budget, key

  def generate(self) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """(function, abstract arguments, static keywords) of `generate`."""
    tokens, lengths, size, budget, key = self._inputs(1)
    params = sampling.SamplingParams.create(0.0, 0, 1.0)
    args = _abstract((tokens, lengths, params, buffers.eos_array(None), key,
                      budget), self.target.mesh)
    return (loops.generate_loop.__wrapped__, (self.target, *args),
            dict(tokens_cap=size, cache_size=size, pad_id=0))

  def speculative(self, drafter: Any, policy: policies.GammaPolicy,
                  num_nodes: int | None = None
                  ) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """The same for `speculative_generate` with `drafter` and `policy`."""
    reserve = (num_nodes or policy.max_gamma) + 1 + drafter.extra_positions
    tokens, lengths, size, budget, key = self._inputs(reserve)
    params = StepParams.create(temperature=0.0)
    args = _abstract((tokens, lengths, params, key, budget, policy),
                     self.target.mesh)
    tokens, lengths, params, key, budget, policy = args
    return (loops.speculative_loop.__wrapped__,
            (self.target, drafter, tokens, lengths, params, key, budget,
             policy),
            dict(tokens_cap=size, cache_size=size, pad_id=0,
                 num_nodes=num_nodes))

  def generate_step(self):
    """One autoregressive step after the prefill, on its own."""
    _, args, static = self.generate()
    target, _, _, params, eos, key, budget = args

    def started(target, tokens, lengths, params, eos, key, budget):
      return loops.start(target, tokens, lengths, params, eos, key,
                         cache_size=static["cache_size"],
                         width=static["tokens_cap"] + 1,
                         max_new_tokens=budget)
    s0 = jax.eval_shape(started, *args)

    def step(target, s0, params, eos, key, budget):
      e = plain.target_step(target, s0.cache, s0.first, s0.params, key,
                            s0.tokens, s0.counts, s0.done, eos, budget,
                            None, s0.stop_state)
      return e.tokens, e.cache
    return step, (target, s0, params, eos, key, budget), {}

  def speculative_step(self, drafter: Any, policy: policies.GammaPolicy,
                       num_nodes: int | None = None):
    """One speculative step (draft, verify, commit) after the prefill."""
    _, args, static = self.speculative(drafter, policy, num_nodes)
    target, drafter, tokens, lengths, params, key, budget, policy = args

    def init(target, drafter, tokens, lengths, params, key, budget, policy):
      return loops.init_spec_state(
          target, drafter, tokens, lengths, params, key, policy=policy,
          max_new_tokens=budget, cache_size=static["cache_size"],
          tokens_cap=static["tokens_cap"])
    state = jax.eval_shape(init, *args)

    def step(target, drafter, state, params, budget, policy):
      return speculate.speculate_step(
          state, target=target, drafter=drafter, params=params,
          policy=policy, max_new_tokens=budget, num_nodes=num_nodes)
    return step, (target, drafter, state, params, budget, policy), {}

