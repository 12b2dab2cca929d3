"""The batch crossover compiled for a chip: where speculation stops paying.

For each batch size B, compiles the decoding steps of one of
`report.PAIRS` for a chip with none attached (`report.models`): the
`generate` step, prompt lookup's step at each γ and the draft model's at
each γ. Each step's HBM bytes and matrix-product FLOPs are counted in its
HLO (`hlo.count`) and priced kernel by kernel at the slower of the chip's
bandwidth and its bf16 peak (`HloCount.roofline_s`). A step of B rows then
yields about B·τ(α, γ) tokens (1 per row for `generate`); `tokens_per_s`
simulates the calls on these step costs (`policies.simulate`), fixed γ
and `gamma="auto"` alike.

At small B every step reads the weights once and speculation multiplies
the tokens per read by τ; as B grows the verification pass of B(γ + 1)
rows turns compute-bound first, and past the crossover `generate` wins.
Every figure is compiled, not run (estimated); a step that does not fit
the chip's memory is reported so, as XLA refuses it.
"""

from __future__ import annotations

from typing import Any


from specjax import policies
from specjax import sampling
from specjax.aot import programs as programs_lib
from specjax.aot import report
from specjax.drafters import DraftModel
from specjax.drafters import PromptLookup
from specjax.policies import simulate
from specjax.policies.costs import ForwardCosts

__all__ = ["BATCHES", "markdown", "run", "tokens_per_s"]

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _steps(call: programs_lib.Call, draft: Any, lookup_gammas, model_gammas):
  """name -> (drafter kind, γ, builder, donated argument) of one B's
  decoding steps; the decoding state is donated, as the generation loop
  carries it in place."""
  lookup = PromptLookup(call.target.vocab_size)
  # generate step: (target, state, ...); speculative: (target, drafter,
  # state, ...).
  steps = {"generate step": ("ar", 0, call.generate_step, 1)}
  for kind, drafter, gammas in (("lookup", lookup, lookup_gammas),
                                ("model", DraftModel(draft), model_gammas)):
    for g in gammas:
      steps[f"{kind} γ={g} step"] = (
          kind, g, lambda d=drafter, g=g: call.speculative_step(
              d, policies.Fixed(g)), 2)
  return steps


def run(chip_name: str, pair_name: str, *, chips: int = 1,
        quantize: str | None = None, batches=BATCHES,
        lookup_gammas=(1, 2, 4, 8), model_gammas=(2, 4),
        prompt_len: int = 128, max_new_tokens: int = 128
        ) -> list[dict[str, Any]]:
  """Compiles `pair_name`'s decoding steps at each B for `chips` chips of
  `chip_name` (`report.models`; dense pairs: a mixture of experts' steps
  read a data-dependent number of experts, which `report` bounds).

  Args:
    chip_name, pair_name, chips, quantize: as `report.run`.
    batches: the B to compile.
    lookup_gammas, model_gammas: γ of prompt lookup's and of the draft
      model's steps.
    prompt_len, max_new_tokens: the call whose cache the steps read.

  Returns:
    One dict per (B, step): bytes, FLOPs, roofline ms, the share of that
    time in compute-bound kernels, HBM per chip, whether it fits (all
    compiled, not run).
  """
  chip, compiler, target, draft, _ = report.models(
      chip_name, pair_name, chips=chips, quantize=quantize)
  if target.config.num_experts:
    raise ValueError(f"{pair_name} is a mixture of experts: its steps read "
                     "a data-dependent number of experts (report.run "
                     "bounds them); the crossover takes dense pairs.")
  rows = []
  for batch in batches:
    call = programs_lib.Call(target, batch=batch, prompt_len=prompt_len,
                             max_new_tokens=max_new_tokens)
    for name, (kind, gamma, build, state) in _steps(
        call, draft, lookup_gammas, model_gammas).items():
      row = dict(chip=f"{chip.name}-{chips}", pair=pair_name,
                 weights=quantize or "bfloat16", batch=batch, program=name,
                 kind=kind, gamma=gamma, prompt_len=prompt_len,
                 max_new_tokens=max_new_tokens, compiler=compiler)
      fn, args, static = build()
      # Greedy: each sampling choice priced at its greedy branch.
      c = programs_lib.compile_or_refusal(
          name, fn, *args, static=static, donate=(state,),
          cheapest=(sampling.SCOPE,))
      if isinstance(c, str):
        rows.append(dict(row, fits=False, error=c))
        continue
      memory, compute = c.count.bound_s(chip.bandwidth, chip.bf16_flops)
      seconds = memory + compute
      rows.append(dict(
          row, read_gib=round(
              (c.count.hbm_bytes - c.count.argument_copies) / 2**30, 3),
          relayout_gib=round(c.count.argument_copies / 2**30, 3),
          tflop=round(c.count.flops / 1e12, 4),
          roofline_ms=round(1e3 * seconds, 4),
          compute_share=round(compute / seconds, 3),
          peak_hbm_gib=round(c.peak_bytes / 2**30, 3),
          fits=c.peak_bytes <= chip.hbm_bytes))
  return rows


def tokens_per_s(rows: list[dict[str, Any]], kind: str, alpha: float,
                 gamma: int | None = None) -> float:
  """Tokens/s of one B's `kind` steps (`rows`: that B's, fitting),
  simulated (`policies.simulate`: synthetic acceptance α, the call's N
  per row, a call lasting until its last row is done) on their roofline:
  `generate` (kind "ar"), `Fixed(gamma)`, or, gamma None, `gamma="auto"`
  choosing by these costs as `report._auto` prices a call. A draft
  model's step is priced whole at its width (its γ draft passes in it)."""
  ms = {r["gamma"] + 1: r["roofline_ms"] for r in rows
        if r["kind"] in ("ar", kind)}
  if kind == "ar":  # one token per row and step
    return rows[0]["batch"] * 1e3 / ms[1]
  costs = policies.StepCosts.from_forwards(
      max(ms) - 1, ForwardCosts(rows[0]["batch"], ms, "roofline"), None,
      "roofline")
  policy = (policies.Auto.from_costs(costs) if gamma is None
            else policies.Fixed(gamma))
  return simulate.simulate(policy, costs, alpha=alpha,
                           batch=rows[0]["batch"],
                           tokens=rows[0]["max_new_tokens"], samples=64)


def markdown(rows: list[dict[str, Any]], alpha: float = 0.8) -> str:
  """One table row per B (`tokens_per_s` at α): `generate`, the best γ of
  prompt lookup and of the draft model, lookup's `gamma="auto"`, each
  over `generate`, and how compute-bound lookup's γ = 4 step is."""
  lines = ["| B | generate ms / step | generate tok/s | lookup: best γ, "
           "tok/s, × generate | lookup, γ auto: tok/s, × generate | draft "
           "model: best γ, tok/s, × generate | lookup γ=4 step "
           "compute-bound | HBM GiB / chip (largest) |",
           "|---|---|---|---|---|---|---|---|"]
  for batch in sorted({r["batch"] for r in rows}):
    fit = [r for r in rows if r["batch"] == batch and r["fits"]]
    ar = next((r for r in fit if r["kind"] == "ar"), None)
    if ar is None:
      lines.append(f"| {batch} | does not fit | | | | | | |")
      continue
    base = tokens_per_s(fit, "ar", alpha)
    cells = []
    for kind in ("lookup", "model"):
      rates = {r["gamma"]: tokens_per_s(fit, kind, alpha, r["gamma"])
               for r in fit if r["kind"] == kind}
      best = max(rates, key=rates.get, default=None)
      cells.append(f"{best}, {rates[best]:.0f}, {rates[best] / base:.2f}x"
                   if best else "does not fit")
    # `auto` chooses among every width up to its γ_max: all must fit.
    whole = {r["gamma"] for r in rows if r["batch"] == batch
             and r["kind"] == "lookup"} == {
                 r["gamma"] for r in fit if r["kind"] == "lookup"}
    rate = tokens_per_s(fit, "lookup", alpha) if whole else None
    cells.insert(1, f"{rate:.0f}, {rate / base:.2f}x" if rate else "")
    four = next((r for r in fit if r["program"] == "lookup γ=4 step"), None)
    share = f"{four['compute_share']:.0%}" if four else ""
    lines.append(f"| {batch} | {ar['roofline_ms']:.2f} | {base:.0f} | "
                 f"{' | '.join(cells)} | {share} | "
                 f"{max(r['peak_hbm_gib'] for r in fit):.2f} |")
  return "\n".join(lines) + "\n"
