"""The ahead-of-time report: a pair's programs compiled for one chip kind.

Every figure is compiled for the chip (a TPU or a GPU), not run. Per
program: the compiler (`chips.compiler`), trace, lower and compile seconds
on this CPU, HLO size, HBM one chip holds against its HBM and against
`specjax.sharding.memory`'s plan; per decoding step: HBM bytes read
(`hlo.count`) against weight plus KV-cache bytes, the step time the chip's
bandwidth implies, and the speedup those step times predict. A mixture of
experts reads a number of experts its tokens choose: its steps are counted
at the most experts each pass can wake, and at the fewest
(`_expert_trips`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import policies
from specjax import testing
from specjax.aot import chips as chips_lib
from specjax.aot import programs as programs_lib
from specjax.drafters import DraftModel
from specjax.drafters import PromptLookup
from specjax.models import MatmulPlan
from specjax.models import moe
from specjax.policies.costs import expected_tokens
from specjax.policies.costs import ForwardCosts
from specjax.sharding import memory

__all__ = ["PAIRS", "Pair", "models", "run"]

# α of the real Qwen pair on CPU (BENCHMARKS.md "Drafters"): the 0.5B
# draft, prompt lookup.
CPU_ALPHA = {"model": 0.958, "lookup": 0.808}
ALPHAS = (0.6, 0.8, 0.9)


@dataclasses.dataclass(frozen=True)
class Pair:
  """A target and its draft, at real shapes (`testing.REAL_SHAPES`).

  Attributes:
    name: what the report calls it.
    target: the target's `REAL_SHAPES` name.
    draft: the draft's, or None for a self-draft (`draft_experts`).
    split_draft: split the draft over the mesh like the target (an 8B
      draft copied to every chip would not leave room for a 70B target's
      share); False replicates it.
    draft_experts: k > 0: the draft is the mixture-of-experts target
      routing each token to its top k experts (`moe.fewer_experts`): the
      target's own arrays, split as they are, built inside each program
      from the target it is given, so the compiled program holds the
      weights once.
  """

  name: str
  target: str
  draft: str | None
  split_draft: bool = False
  draft_experts: int = 0


PAIRS = {
    "qwen1.5b": Pair("qwen1.5b", "qwen2.5-coder-1.5b-instruct",
                     "qwen2.5-coder-0.5b-instruct"),
    "llama8b": Pair("llama8b", "llama-3-8b", "llama-3.2-1b"),
    "llama70b": Pair("llama70b", "llama-3-70b", "llama-3-8b",
                     split_draft=True),
    # Mixtures of experts drafting with fewer of their own experts: top 1
    # of Mixtral's 2, top 2 of Qwen3-MoE's 8.
    "mixtral8x7b": Pair("mixtral8x7b", "mixtral-8x7b", None,
                        split_draft=True, draft_experts=1),
    "qwen3-30b-a3b": Pair("qwen3-30b-a3b", "qwen3-30b-a3b", None,
                          split_draft=True, draft_experts=2),
}
# The decoding steps alone (what `scripts/aot_report.py`'s ":steps" runs);
# "lookup γ=4 step" is a verification pass of γ + 1 = 5 tokens whose draft
# reads nothing, compiled for mixtures of experts only.
STEPS = ("generate step", "model γ=4 step", "lookup γ=4 step")


def _auto(chip: chips_lib.Chip, target_bytes: float, draft_bytes: float,
          max_gamma: int = 8) -> policies.Auto:
  """`gamma="auto"` priced as the chip's bandwidth prices each forward
  (memory-bound at B = 1: a pass of any width up to γ + 1 reads the
  weights and cache once), compiling the widths worth a pass of their own
  (1 and γ + 1)."""
  ms = lambda b: {t: 1e3 * b / chip.bandwidth for t in (1, max_gamma + 1)}
  return policies.Auto.from_costs(policies.StepCosts.from_forwards(
      max_gamma, ForwardCosts(1, ms(target_bytes), "roofline"),
      ForwardCosts(1, ms(draft_bytes), "roofline"),
      "roofline").worth_compiling())


def _self_drafted(build, k: int):
  """A program of `build` (target, drafter, ...) whose drafter is made
  inside it from the target: `moe.fewer_experts(target, k)`. Passed as an
  argument of its own, the draft's parameters (the target's arrays) would
  count twice in XLA's memory analysis."""
  def built():
    fn, (target, _, *rest), static = build()

    def self_drafted(target, *rest, **kwargs):
      drafter = DraftModel(moe.fewer_experts(target, k))
      return fn(target, drafter, *rest, **kwargs)
    return self_drafted, (target, *rest), static
  return built


def _programs(call: programs_lib.Call, draft: Any, full: bool,
              auto: policies.Auto, draft_experts: int = 0):
  """name -> (kind, γ, builder) of the programs to compile."""
  vocab = call.target.vocab_size
  model, lookup = DraftModel(draft), PromptLookup(vocab)
  drafted = ((lambda b: _self_drafted(b, draft_experts)) if draft_experts
             else (lambda b: b))
  out = {
      "generate step": ("ar", 0, call.generate_step),
      "model γ=4 step": ("model", 4, drafted(lambda: call.speculative_step(
          model, policies.Fixed(4)))),
      "lookup γ=8 step": ("lookup", 8, lambda: call.speculative_step(
          lookup, policies.Fixed(8))),
      "generate": ("", 0, call.generate),
      "model γ=4": ("", 4, drafted(lambda: call.speculative(
          model, policies.Fixed(4)))),
  }
  if call.target.config.num_experts:
    out["lookup γ=4 step"] = ("lookup", 4, lambda: call.speculative_step(
        lookup, policies.Fixed(4)))
  if full:
    out.update({
        "lookup γ=8": ("", 8, lambda: call.speculative(
            lookup, policies.Fixed(8))),
        "tree 16 nodes, depth 4": ("", 4, drafted(lambda: call.speculative(
            model, policies.Fixed(4, 16), num_nodes=16))),
        "model, γ auto": ("", 8, drafted(
            lambda: call.speculative(model, auto))),
    })
  return out


def _expert_trips(kind: str, gamma: int, target: Any, draft: Any
                  ) -> tuple[list[int], list[int]]:
  """Distinct experts per layer of each mixture-of-experts pass of one
  decoding step, fewest and most: a pass of T tokens wakes between k (all
  choose the same) and min(T·k, X) (none share one). `hlo.count` runs the
  expert loop of each pass once (its trip count is data), so a step reads
  (n - 1) more experts per layer and pass than it counts.

  The passes: the target's (T = γ + 1 when verifying); a draft model's
  catch-up (T = 2) and its γ - 1 single-token passes. A draft's wider
  catch-up pass, which runs only after steps it sat out, stays counted
  once, as it is for a dense draft.
  """
  passes = [(1 if kind == "ar" else gamma + 1, target)]
  if kind == "model" and draft.num_experts:
    passes += [(2, draft)] + [(1, draft)] * (gamma - 1)
  fewest = [c.num_experts_per_tok for _, c in passes]
  most = [min(t * c.num_experts_per_tok, c.num_experts) for t, c in passes]
  return fewest, most


def models(chip_name: str, pair_name: str, *, chips: int = 1,
           quantize: str | None = None, scan: bool | None = None
           ) -> tuple[chips_lib.Chip, str, Any, Any, Any]:
  """(chip, compiler, target, draft, dtype): `pair_name`'s models,
  abstract, on a mesh of `chips` chips of `chip_name` (`run`'s
  arguments), and their activations' dtype."""
  if chip_name == "attached":
    chip, devices = chips_lib.attached(chips)
    compiler = f"jax {jax.__version__}"
  else:
    chip = chips_lib.CHIPS[chip_name]
    devices = chips_lib.devices(chip, chips)
    compiler = chips_lib.compiler(chip)
  pair = PAIRS[pair_name]
  mesh = programs_lib.make_mesh(devices)
  backend = devices[0].platform
  if scan is None:
    scan = MatmulPlan.for_backend(backend).scan_layers
  # bf16 on accelerators, float32 on CPU (`hardware.default_dtype`).
  dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
  shapes = dict(mesh=mesh, quantize=quantize, scan=scan, dtype=dtype)
  target = programs_lib.abstract_model(testing.REAL_SHAPES[pair.target],
                                       **shapes)
  if pair.draft_experts:
    draft = moe.fewer_experts(target, pair.draft_experts)
  else:
    draft = programs_lib.abstract_model(testing.REAL_SHAPES[pair.draft],
                                        split=pair.split_draft, **shapes)
  return chip, compiler, target, draft, dtype


def run(chip_name: str, pair_name: str, *, chips: int = 1,
        quantize: str | None = None, scan: bool | None = None,
        full: bool = False,
        only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
  """Compiles `pair_name`'s programs for `chips` chips of `chip_name`.

  Args:
    chip_name: a `chips.CHIPS` key (compiled with no chip attached:
      `chips.devices`), or "attached": this runtime's own
      devices (a Colab TPU or GPU, or the CPU), priced by their nominal
      bandwidth (`policies.Roofline.nominal`).
    pair_name: a `PAIRS` key.
    chips: chips in the mesh (the target split over them, the draft
      replicated).
    quantize: None (bf16) or "int8" (weight-only) for both models.
    scan: the scanned layout (False: every layer unrolled); default: the
      layout the devices' backend gets (`MatmulPlan.for_backend`).
    full: also the lookup and tree generations.
    only: compile only these program names.

  Returns:
    One dict per program (compiled for the chip, not run).
  """
  chip, compiler, target, draft, dtype = models(
      chip_name, pair_name, chips=chips, quantize=quantize, scan=scan)
  pair, mesh = PAIRS[pair_name], target.mesh
  call = programs_lib.Call(target)
  _, inputs, fixed = call.speculative(DraftModel(draft), policies.Fixed(8))
  size = fixed["cache_size"]
  # Bytes per chip of a target forward and of a draft forward.
  target_bytes = (target.weight_bytes_per_token + programs_lib.kv_bytes(
      target.config, dtype, call.batch, size)) / chips
  draft_bytes = (draft.weight_bytes_per_token + programs_lib.kv_bytes(
      draft.config, dtype, call.batch, size)) / (
          chips if pair.split_draft else 1)
  plan = memory.plan({"target": target, "draft": draft}, batch=call.batch,
                     cache_size=size, chunk=9,
                     prompt_width=inputs[2].shape[1], mesh=mesh,
                     limit=None).per_device
  rows, step_s, fewest_s = [], {}, {}
  auto = _auto(chip, target_bytes, draft_bytes)
  # One expert's share of every layer on one chip (experts split on F; a
  # self-draft's experts are the target's).
  expert_chip = moe.expert_bytes(target.config, target.params) / chips
  for name, (kind, gamma, build) in _programs(
      call, draft, full, auto, pair.draft_experts).items():
    if only and name not in only:
      continue
    fn, args, static = build()
    row = dict(chip=f"{chip.name}-{chips}", pair=pair.name,
               weights=quantize or jnp.dtype(dtype).name,
               layout="scan" if scan else "unrolled", program=name,
               chip_hbm_gib=chip.hbm_bytes / 2**30, compiler=compiler)
    c = programs_lib.compile_or_refusal(name, fn, *args, static=static)
    if isinstance(c, str):
      rows.append(dict(row, fits=False, error=c))
      continue
    # The compiled program is one device's: its shapes are shards.
    read = c.count.hbm_bytes
    expect = target_bytes + (gamma * draft_bytes if kind == "model" else 0)
    row.update(
        trace_s=round(c.trace_s, 2),
        lower_s=round(c.lower_s, 2), compile_s=round(c.compile_s, 2),
        instructions=c.count.instructions, fusions=c.count.fusions,
        while_loops=c.count.while_loops,
        peak_hbm_gib=round(c.peak_bytes / 2**30, 3),
        fits=c.peak_bytes <= chip.hbm_bytes,
        plan_gib=round(plan / 2**30, 3),
        collectives=c.count.collectives,
        unknown_trips=c.count.unknown_trips,
        largest=[(round(b / 2**30, 3), op, where[-90:])
                 for b, op, where in c.count.largest[:4]])
    if kind and target.config.num_experts:
      fewest, most = (expert_chip * sum(n - 1 for n in trips) for trips in
                      _expert_trips(kind, gamma, target.config,
                                    draft.config))
      row.update(step_read_gib_hlo=round(read / 2**30, 3),
                 step_read_gib_fewest=round((read + fewest) / 2**30, 3))
      fewest_s[kind] = (read + fewest) / chip.bandwidth
      read += most
    if kind:
      step_s[kind] = read / chip.bandwidth
      row.update(step_read_gib=round(read / 2**30, 3),
                 step_written_gib=round(c.count.hbm_written / 2**30, 3),
                 step_expected_gib=round(expect / 2**30, 3),
                 step_ratio=round(read / expect, 3),
                 step_ms_roofline=round(1e3 * read / chip.bandwidth, 3),
                 gamma=gamma)
    if kind in CPU_ALPHA and "ar" in step_s:  # compiled before the others
      # The CPU's α is a dense 0.5B draft's, not a self-draft's.
      alphas = ALPHAS + (() if kind == "model" and pair.draft_experts
                         else (CPU_ALPHA[kind],))
      predict = lambda seconds: {  # τ(α, γ) x the step-time ratio
          str(a): round(expected_tokens([a] * gamma, gamma)
                        * seconds["ar"] / seconds[kind], 2) for a in alphas}
      row["predicted_speedup"] = predict(step_s)
      if kind in fewest_s:  # every pass's tokens sharing their experts
        row["predicted_speedup_fewest"] = predict(fewest_s)
    rows.append(row)
  return rows

def markdown(rows: list[dict[str, Any]]) -> str:
  """Two tables of `run`'s rows: the decoding steps, scanned where they
  were compiled both ways (one row per step on the chips of one count and
  platform: a step moves the same bytes on v5e and v6e, which the roofline
  divides by their bandwidths; a GPU compiles its own HLO), then the whole
  programs' compile seconds and memory. Figures are compiled, not run."""
  gib = lambda x: "" if x is None else f"{x:.2f}"
  pairs = list(dict.fromkeys(r["pair"] for r in rows))
  rows = sorted(rows, key=lambda r: (
      int(r["chip"].rsplit("-", 1)[1]), pairs.index(r["pair"]),
      r["weights"] != "bfloat16", r["chip"], r["layout"] != "scan"))
  scanned = {(r["chip"], r["pair"], r["weights"], r["program"])
             for r in rows if r["layout"] == "scan"}
  groups = {}  # (chips, platform, pair, weights, step) -> rows
  progs = ["| chip | pair | weights | layout | program | compile s | HLO "
           "instructions | HBM GiB / chip (XLA) | plan GiB | fits |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    head = f"| {r['chip']} | {r['pair']} | {r['weights']} |"
    if "error" in r:
      progs.append(f"{head} {r['layout']} | {r['program']} | | | "
                   f"{r['error'][:60]} | | **no** |")
    elif "step_read_gib" not in r:
      progs.append(
          f"{head} {r['layout']} | {r['program']} | {r['compile_s']:.1f} | "
          f"{r['instructions']} | {gib(r['peak_hbm_gib'])} | "
          f"{gib(r['plan_gib'])} | {'yes' if r['fits'] else '**no**'} |")
    # A step's row in the layout its backend runs: scanned where compiled
    # both ways (accelerators), else as compiled (the CPU's own layout).
    elif r["layout"] == "scan" or (
        r["chip"], r["pair"], r["weights"], r["program"]) not in scanned:
      name, chips = r["chip"].rsplit("-", 1)
      chip = chips_lib.CHIPS.get(name)
      groups.setdefault((chips, chip.platform if chip else name, r["pair"],
                         r["weights"], r["program"]), []).append(r)
  steps = ["| chips | pair | weights | step | GiB read / chip | weights + "
           "KV / chip | ratio | roofline ms | collectives | predicted "
           "speedup at α = 0.6 / 0.8 / 0.9 / CPU's α |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for (_, _, pair, weights, step), rs in groups.items():
    first = rs[0]
    both = lambda key, f: " / ".join(f(r[key]) for r in rs)
    speed = first.get("predicted_speedup")
    speed = " / ".join(f"{v:.2f}" for v in speed.values()) if speed else ""
    steps.append(
        f"| {' / '.join(r['chip'] for r in rs)} | {pair} | {weights} | "
        f"{step} | {both('step_read_gib', gib)} | "
        f"{gib(first['step_expected_gib'])} | "
        f"{both('step_ratio', lambda x: f'{x:.3f}')} | "
        f"{both('step_ms_roofline', lambda x: f'{x:.2f}')} | "
        f"{first['collectives']:.0f} | {speed} |")
  tables = [steps] + ([progs] if len(progs) > 2 else [])
  return "\n\n".join("\n".join(t) for t in tables) + "\n"
