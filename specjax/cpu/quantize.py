"""Float weights or a GGUF file's own blocks: measured once per machine.

Shape letters (`specjax.shapes`): E hidden, V vocab, L layers, X rows per
product (batch times chunk).

`registry.load_pretrained(..., quantize="auto")` keeps a GGUF file's own
blocks (`quantize="gguf"`) where that model is the faster one here, else
its float weights. The two are the same model (the blocks dequantise to
the float loader's weights bit for bit, and speculation is exact for
either), so the choice is about speed alone, and speed depends on the CPU:
the block kernel is bound by compute (unpacking), the float product by
memory (BENCHMARKS.md "Quantized weights").

The choice is priced by the job the caller will run, a `Workload`: the
matrix products of one decoding call by rows per product, the layers' and
the vocabulary head's apart. `generate` is its prefill (chunks of B · 64
rows through the layers, then the head for each prompt's last position)
and one B-row step per token; a speculative call at γ is the same prefill
and one B(γ+1)-row verification pass per step: as many steps as an
earlier run of the same job took where
the caller knows them (`Workload.decoding(steps=...)`; the experiments
record them per job), else E[steps] at the acceptance `gamma="auto"`
assumes before measuring (`policies.auto.PRIOR`). A draft model's passes
are the same for either target and are not priced. The blocks can win a
decode step (they read a quarter of the bytes) and lose a verification
pass or a prefill chunk (their unpacking is compute), so the job, not one
step, decides.

`choose` times, at each X the workload needs, the layers' and the head's
products of one forward of each candidate, multiplied as the model's
forward multiplies them (in the kernel at any X through the layer loop's
`LayerPick`s, where the plan loops): one candidate's products
round-robin, then the other's, in passes until two agree
(`hardware.settled_ms`), so that neither a slow moment of a shared
machine nor the other candidate's products decide:

- "gguf": the model's own block matrices, all L layers and the head,
  through the plan a quantized model gets (the CPU kernel, which its
  layer loop sends every X);
- "float": matrices of the same shapes stored and multiplied as the
  float model's plan (`specjax.cpu.plans.tune`), on enough layers to
  exceed the caches, scaled to L, and the whole [V, E] head.

It keeps the candidate of least time over the workload. The timings are
cached in `<cache>/tuning/quantize.json` under a key naming the machine,
kernel sources, both plans, dtype, shapes and the file's block types,
per X: a later workload measures only the X it adds; deleting the file
re-measures.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import os
import pathlib
from typing import Any, Callable, Mapping, Sequence

import gguf
import jax
import jax.numpy as jnp

from specjax import hardware
from specjax import store
from specjax.checkpoints import gguf_blocks
from specjax.checkpoints.gguf import read_config
from specjax.checkpoints.gguf_reader import GGUFFile
from specjax.cpu import plans
from specjax.cpu.matmul import SMALLM
from specjax.models import MatmulPlan
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models.matmul import LayerPick
from specjax.models.decoder import PREFILL_CHUNK
from specjax.models.decoder import prefill_split
from specjax.models.matmul import project
from specjax.policies import auto
from specjax.policies import costs

__all__ = ["KERNEL_PLAN", "QuantizeChoice", "Workload", "block_types",
           "cache_file", "choose", "choose_for_file"]

# The plan `load_pretrained` gives a quantized model where the kernels are.
KERNEL_PLAN = MatmulPlan.parse("out_in/kernel", SMALLM)
_REPEATS = 7


def _by_rows(*passes: tuple[int, float]) -> tuple[tuple[int, float], ...]:
  """(X, passes) pairs summed per X, X ascending."""
  out: dict[int, float] = {}
  for rows, n in passes:
    out[rows] = out.get(rows, 0.0) + n
  return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class Workload:
  """The matrix products of one decoding call, by rows per product.

  Attributes:
    passes: ((X, passes per call), ...) through the layers, X rows per
      product, X ascending.
    head_passes: the same for the vocabulary head.
    label: the call, for reports.
  """

  passes: tuple[tuple[int, float], ...]
  head_passes: tuple[tuple[int, float], ...]
  label: str

  @classmethod
  def decoding(cls, *, batch: int = 1, prompt_tokens: float = 128,
               new_tokens: int = 128, gamma: int = 0, width: int | None = None,
               acceptance: float = auto.PRIOR, steps: float | None = None
               ) -> "Workload":
    """`generate` (γ = 0) or a speculative call at γ.

    Args:
      batch: B rows.
      prompt_tokens: the prompts' mean length P. `Decoder.prefill` runs
        floor(P / 64) chunks of B · 64 rows (`models.decoder
        .PREFILL_CHUNK`), then the rest in one piece of 16, 32 or 64 rows
        (priced as that share of a chunk), then the head on B rows.
      new_tokens: N per row.
      gamma: γ draft tokens per step (0: autoregressive).
      width: rows per row of a verification pass (default γ + 1; a tree
        of T nodes verifies T + 1).
      acceptance: each position's acceptance, for E[steps] to N tokens.
      steps: verification passes per call measured by an earlier run of
        the job (replaces E[steps] at `acceptance`).
    """
    if batch < 1 or new_tokens < 1 or prompt_tokens < 1 or gamma < 0:
      raise ValueError(f"batch, new_tokens and prompt_tokens must be >= 1 "
                       f"and gamma >= 0, got {batch}, {new_tokens}, "
                       f"{prompt_tokens}, {gamma}.")
    if steps is not None and not (gamma and 1 <= steps <= new_tokens):
      raise ValueError(f"measured steps must be in [1, {new_tokens}] and "
                       f"need gamma >= 1, got {steps} at gamma={gamma}.")
    width = gamma + 1 if width is None else width
    full, piece = prefill_split(prompt_tokens)
    chunks = full + piece / PREFILL_CHUNK
    how = "measured" if steps is not None else f"at acceptance {acceptance}"
    if steps is None:
      steps = (costs.expected_steps([acceptance] * gamma, gamma, new_tokens,
                                    batch) if gamma else new_tokens)
    call = (f"speculative decoding at γ={gamma} ({steps:.1f} passes of "
            f"{batch * width} rows, {how})" if gamma
            else f"generate ({steps} steps of {batch} rows)")
    return cls(_by_rows((batch * PREFILL_CHUNK, chunks),
                        (batch * width, steps)),
               _by_rows((batch, 1.0), (batch * width, steps)),
               f"{call} after {chunks:g} prefill chunk(s) of "
               f"{batch * PREFILL_CHUNK} rows, B={batch}, N={new_tokens}")

  @property
  def rows(self) -> tuple[int, ...]:
    return tuple(x for x, _ in self.passes)

  @property
  def head_rows(self) -> tuple[int, ...]:
    return tuple(x for x, _ in self.head_passes)

  def cost(self, ms: Mapping[str, float], head_ms: Mapping[str, float]
           ) -> float:
    """ms of one call, from {str(X): ms of one forward's products} of the
    layers (`ms`) and of the head (`head_ms`)."""
    return (sum(n * ms[str(x)] for x, n in self.passes)
            + sum(n * head_ms[str(x)] for x, n in self.head_passes))


@dataclasses.dataclass(frozen=True)
class QuantizeChoice:
  """What `quantize="auto"` resolved to, and why.

  Attributes:
    quantize: "gguf" or None (float weights).
    source: "measured", "cache", or "fixed" (nothing to measure: `why`).
    model_ms: "float" / "gguf" -> {str(X): estimated ms of one forward's
      matrix products through the layers at X rows}; empty when fixed.
    head_ms: the same for the vocabulary head.
    workload: the call priced (`Workload.label`).
    call_ms: "float" / "gguf" -> ms of the workload's products; empty
      when fixed.
    why: one sentence for reports.
    key: the cache key ("" when fixed).
  """

  quantize: str | None
  source: str
  model_ms: dict[str, dict[str, float]]
  head_ms: dict[str, dict[str, float]]
  workload: str
  call_ms: dict[str, float]
  why: str
  key: str = ""

  @classmethod
  def fixed(cls, why: str, workload: Workload) -> "QuantizeChoice":
    """Float weights, nothing measured: `why` the blocks cannot win."""
    return cls(None, "fixed", {}, {}, workload.label, {},
               f"float weights: {why}")

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def cache_file(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  return store.path_for("quantize", cache_dir)


def block_types(reader: GGUFFile) -> collections.Counter:
  """The file's quantized tensor types and their counts."""
  return collections.Counter(
      t.tensor_type.name for t in reader.tensors
      if gguf.GGML_QUANT_SIZES[t.tensor_type][0] > 1)


def _check_entry(entry: Any) -> None:
  # Entries under keys without "|layers,head" price the head inside
  # model_ms and have no head_ms; `choose` never reads them.
  for part in ("model_ms", "head_ms"):
    if set(entry.get(part, entry["model_ms"])) != {"float", "gguf"}:
      raise ValueError("an entry lacks a candidate's timings")


def _layers(model: Model) -> list[dict[str, Any]]:
  """The model's layers' parameters (q, k, v, ..., down among them)."""
  return [model.params[f"layers_{i}"]
          for i in range(model.config.num_layers)]


def _as_looped(layers: list[dict[str, Any]], plan: MatmulPlan, dtype: Any
               ) -> list[dict[str, Any]]:
  """`layers` as the model's forward multiplies them: where its plan runs
  them as a loop (`Transformer._loops`), every matrix, float or packed,
  goes to the kernel at any X (`LayerPick`)."""
  if not plan.loops(layers, dtype):
    return layers
  zero = jnp.zeros((), jnp.int32)
  return [{n: LayerPick(ws=(w,), index=zero) if w.ndim == 2 else w
           for n, w in layer.items()} for layer in layers]


def _head(model: Model) -> Any:
  """The vocabulary head [V, E]: `lm_head`, else the tied embedding."""
  return model.params.get("lm_head", model.params["embed"])


def _measure(config: ModelConfig, dtype: Any, float_plan: MatmulPlan,
             blocks: Model, blocks_plan: MatmulPlan, rows: Sequence[int],
             head_rows: Sequence[int]
             ) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
  """Estimated ms of one forward's products per candidate: through the
  layers at each X of `rows`, through the head at each X of `head_rows`."""
  blocks = blocks.with_plan(blocks_plan)
  layers, head = plans.stack(config, dtype, float_plan,
                              head_rows=config.vocab_size)
  candidates = {
      "float": (float_plan, _as_looped(layers, float_plan, dtype), head,
                config.num_layers / len(layers)),
      "gguf": (blocks.plan, _as_looped(_layers(blocks), blocks.plan, dtype),
               _head(blocks), 1.0)}
  run = jax.jit(plans.run_layers, static_argnames="plan")
  logits = jax.jit(project, static_argnames="plan")
  xs = {m: jnp.full((m, config.hidden_size), 0.5, dtype)
        for m in {*rows, *head_rows}}
  steps: dict[tuple[str, str, int], Callable[[], Any]] = {}
  for name, (plan, ws, w_head, _) in candidates.items():
    for m in rows:
      steps[(name, "layers", m)] = (
          lambda x=xs[m], ws=ws, p=plan: run(x, ws, plan=p))
    for m in head_rows:
      steps[(name, "head", m)] = (
          lambda x=xs[m], w=w_head, p=plans.head_plan(plan): logits(
              x, w, plan=p))
  times = hardware.settled_ms(steps, _REPEATS, group=lambda k: k[0])
  return {name: ({str(m): times[(name, "layers", m)] * scale for m in rows},
                 {str(m): times[(name, "head", m)] for m in head_rows})
          for name, (_, _, _, scale) in candidates.items()}


def choose(config: ModelConfig, blocks: Callable[[], Model], *,
           types: str, float_plan: MatmulPlan, workload: Workload,
           blocks_plan: MatmulPlan = KERNEL_PLAN, dtype: Any = jnp.float32,
           cache_dir: str | os.PathLike | None = None) -> QuantizeChoice:
  """Float or block weights for a GGUF model running `workload` on this
  machine, from timings cached or measured (then cached).

  Args:
    config: the model's shapes.
    blocks: loads the model with its GGUF blocks (`quantize="gguf"`);
      called only when measuring.
    types: the file's block types, "Q4_K*169+Q6_K*29", for the cache key.
    float_plan: the plan of the float model.
    workload: the call to price.
    blocks_plan: the plan of the block model.
    dtype: the float dtype.
    cache_dir: cache root (default `$SPECJAX_CACHE` or ~/.cache/specjax).

  Returns:
    A `QuantizeChoice`.
  """
  key = (f"{plans.cache_key(config, dtype, None)}|float={float_plan.name}"
         f"|blocks={blocks_plan.name}|{types}|layers,head")
  path = cache_file(cache_dir)
  entries = store.read(path, _check_entry)
  entry = entries.get(key, {})
  model_ms = entry.get("model_ms", {"float": {}, "gguf": {}})
  head_ms = entry.get("head_ms", {"float": {}, "gguf": {}})

  def missing(rows: Sequence[int], ms: dict[str, dict[str, float]]
              ) -> list[int]:
    return [x for x in rows if not all(str(x) in t for t in ms.values())]

  layer_rows = missing(workload.rows, model_ms)
  head_rows = missing(workload.head_rows, head_ms)
  source = "cache"
  if layer_rows or head_rows:
    source = "measured"
    for name, (ms, head) in _measure(config, dtype, float_plan, blocks(),
                                     blocks_plan, layer_rows,
                                     head_rows).items():
      model_ms[name].update(ms)
      head_ms[name].update(head)
    entries[key] = {"model_ms": model_ms, "head_ms": head_ms,
                    "measured": datetime.datetime.now().isoformat(
                        timespec="seconds")}
    store.write(path, entries)
  call_ms = {name: workload.cost(model_ms[name], head_ms[name])
             for name in model_ms}
  chosen = min(call_ms, key=call_ms.get)
  other = "float" if chosen == "gguf" else "gguf"
  why = (f"{chosen} weights: {workload.label} costs "
         f"{call_ms[chosen]:.0f} ms of products against "
         f"{call_ms[other]:.0f} ms for {other} here ({source})")
  return QuantizeChoice("gguf" if chosen == "gguf" else None, source,
                        {n: {str(x): model_ms[n][str(x)]
                             for x in workload.rows} for n in model_ms},
                        {n: {str(x): head_ms[n][str(x)]
                             for x in workload.head_rows} for n in head_ms},
                        workload.label, call_ms, why, key)


def choose_for_file(path: str | os.PathLike, dtype: Any,
                    load_blocks: Callable[[], Model], *, workload: Workload,
                    matmul_plan: str | MatmulPlan | None = "auto",
                    rows: Sequence[int] = (1, 5),
                    cache_dir: str | os.PathLike | None = None
                    ) -> QuantizeChoice:
  """What `quantize="auto"` means for the GGUF file `path` and a call of
  `workload`.

  Float weights without measuring where the blocks cannot be the faster
  model: no specjax CPU kernel here, a float dtype other than float32 (an
  accelerator's bfloat16), or a block type the loaders cannot keep; and
  for a mixture of experts, whose layers the timing does not model.

  Args:
    path: the .gguf file.
    dtype: the float model's dtype.
    load_blocks: loads the file with `quantize="gguf"`.
    workload: the call the model will run.
    matmul_plan: `load_pretrained`'s `matmul`: "auto" (both models get
      their tuned plans), a forced plan (both get it), or None.
    rows: X the float model's plan is tuned for (`plans.tune`).
    cache_dir: cache root.
  """
  fixed = functools.partial(QuantizeChoice.fixed, workload=workload)
  if not SMALLM.available():
    return fixed("the specjax CPU kernels are not available here")
  if jnp.dtype(dtype) != jnp.float32:
    return fixed(f"the float model is {jnp.dtype(dtype).name}, and the "
                 "block kernels are CPU float32")
  reader = GGUFFile(path)
  counts = block_types(reader)
  odd = sorted(set(counts) - {q.name for q in gguf_blocks.SUPPORTED})
  if odd:
    return fixed(f"{os.fspath(path)} has blocks of type(s) {odd}, which "
                 "quantize='gguf' does not keep")
  config = read_config(reader)
  del reader
  if config.num_experts:
    return fixed("a mixture of experts: the timed products are a dense "
                 "layer's; quantize='gguf' keeps its blocks")
  if matmul_plan is None:
    float_plan = blocks_plan = MatmulPlan()
  else:
    tuned = plans.tune(config, dtype, rows=tuple(int(m) for m in rows),
                       matmul=matmul_plan, cache_dir=cache_dir)
    float_plan = tuned.plan
    blocks_plan = float_plan if tuned.source == "forced" else KERNEL_PLAN
  types = "+".join(f"{name}*{n}" for name, n in sorted(counts.items()))
  return choose(config, load_blocks, types=types, float_plan=float_plan,
                workload=workload, blocks_plan=blocks_plan, dtype=dtype,
                cache_dir=cache_dir)
