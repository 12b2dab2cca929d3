r"""A γ policy's expected loss, by simulation, on measured cost sets.

For each cost set and α, `specjax.policies.simulate.over_best`: `Auto`'s
mean tokens/s over many draws of synthetic acceptance, priced by the cost
model, over the best of autoregressive decoding and every fixed γ <= γ_max
in hindsight. No timing noise: it scores a policy change on several
machines' costs in seconds (BENCHMARKS.md, "Never slower").

COMMAND (BENCHMARKS.md, "Never slower": every committed cost table, cold,
after a settled start and after one earlier generation):
  python scripts/simulate_policy.py --runs='results/never_slower/*' \
    --alphas=0.05/0.5/0.8/0.95 --error=0.9/1/1.1 --samples=128 --warm
COMMAND (machine G's B = 1 costs against the same policy without its
confidence bound):
  python scripts/simulate_policy.py \
    --costs=G1=213.4/249.9/263.6/283.9:71.2/78.6 --optimism=0/1
COMMAND (the choice by the steady state, horizon 0, against the choice by
when the batch ends, on the costs of sweep runs, cold and warm):
  python scripts/simulate_policy.py --runs=/tmp/bench/g_b16a8 \
    --horizon=0/64 --warm
COMMAND (the costs a crossover run measured, each B and α row):
  python scripts/simulate_policy.py --runs=/tmp/bench/e_b1,/tmp/bench/e_b2
COMMAND (`Auto.margin` against a table whose drafting steps are 10% off,
either way, the worst and mean cell of each margin at the end):
  python scripts/simulate_policy.py --runs=/tmp/bench/r19_b2 \
    --margin=0/0.03/0.05 --error=0.9/1/1.1 --samples=128

A cost set is NAME=t(1)/t(2)/t(3)/t(5):d(1)/d(2): the target's ms at the
widths of `--max_gamma` (`policies.verify_widths`; 1, 2, 3, 5 for 4) and
the draft model's ms at 1 and 2 tokens; d = 0 is a drafter that runs no
model (prompt lookup).

An α is one acceptance for every draft position, or one per position
(`--alphas=0.44:0.95:0.95:0.95`, prompt lookup's shape: its first draft
is often wrong, and once it is right the rest of the match follows).

With `--error`, the policy still chooses by the cost set while the
simulation prices its drafting steps (the draft forwards and every target
pass wider than one token) at that factor times the set's: how a policy
fares on a table whose error it cannot see.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os

from absl import app
from absl import flags

import numpy as np

from specjax import policies
from specjax.policies import simulate

_COSTS = flags.DEFINE_list("costs", [], "Cost sets, NAME=T/T/T/T:D/D.")
_RUNS = flags.DEFINE_list(
    "runs", [], "crossover output dirs (or glob patterns) whose "
    "measured costs to use, e.g. 'results/never_slower/*' (the committed "
    "ones).")
_ALPHAS = flags.DEFINE_string(
    "alphas", "0.05/0.5/0.8/0.95", "/-separated α values: one for every "
    "draft position, or a:b:... one per position (γ_max of them).")
_BATCH = flags.DEFINE_integer(
    "batch", 0, "B simulated; 0: each run's own (1 for --costs).")
_TOKENS = flags.DEFINE_integer("tokens", 32, "New tokens per row.")
_OPTIMISM = flags.DEFINE_string("optimism", "1", "`Auto` optimism values.")
_HORIZON = flags.DEFINE_string("horizon", "64", "`Auto` horizon values.")
_MARGIN = flags.DEFINE_string("margin", "0.03", "`Auto` margin values.")
_PROBE_PRICE = flags.DEFINE_string("probe_price", "0.25",
                                   "`Auto` probe_price values.")
_ERROR = flags.DEFINE_string(
    "error", "1", "Factors by which the drafting steps' true costs differ "
    "from the cost set the policy chooses by.")
_WARM = flags.DEFINE_boolean(
    "warm", False, "Also score each policy started warm, as cold / settled "
    "/ after one: from steady estimates at α (`simulate.settled`), and "
    "from the state one earlier generation ended with (`warm_after=1`).")
_SAMPLES = flags.DEFINE_integer("samples", 256, "Generations simulated.")
_OBSERVE = flags.DEFINE_string(
    "observe_first", "1", "/-separated 1 or 0: whether each row observes "
    "position 1 at prefill (`GammaPolicy.observe`) where the costs have a "
    "draft model, as `speculative_generate` does; 0: a first-step probe.")
_MAX_GAMMA = flags.DEFINE_integer(
    "max_gamma", 4, "γ_max of --costs (a run's own for --runs).")


def _floats(text: str) -> list[float]:
  return [float(x) for x in text.split("/") if x]


def _alphas(text: str) -> list[float | tuple[float, ...]]:
  """--alphas: each entry one α, or a:b:... one per draft position."""
  return [tuple(float(a) for a in x.split(":")) if ":" in x else float(x)
          for x in text.split("/") if x]


def cost_sets() -> list[tuple[str, int, policies.StepCosts]]:
  """(name, B, costs) from --costs and --runs."""
  sets = []
  for spec in _COSTS.value:
    name, _, values = spec.partition("=")
    target, _, draft = values.partition(":")
    draft = _floats(draft) or [0.0]  # d(1), d(2); one value: both
    sets.append((name, 1, policies.StepCosts(
        max_gamma=_MAX_GAMMA.value, target_ms=tuple(_floats(target)),
        draft_ms=draft[0], first_draft_ms=draft[-1])))
  runs = sorted(run for pattern in _RUNS.value for run in glob.glob(pattern)
                if os.path.isdir(run))
  for run in runs:
    with open(os.path.join(run, "crossover.json")) as f:
      run_data = json.load(f)
    seen = set()
    for r in run_data["results"]:
      key = (r["batch"], tuple(r["target_ms"].values()))
      if key in seen:
        continue
      seen.add(key)
      draft = r.get("draft_ms") or {}  # none for a drafter without a model
      sets.append((f"{os.path.basename(run)} B={r['batch']}", r["batch"],
                   policies.StepCosts(
                       max_gamma=run_data["max_gamma"],
                       target_ms=tuple(r["target_ms"][k] for k in sorted(
                           r["target_ms"], key=int)),
                       draft_ms=draft.get("1", 0.0),
                       first_draft_ms=draft.get("2", draft.get("1", 0.0)))))
  return sets


def scaled(costs: policies.StepCosts, factor: float) -> policies.StepCosts:
  """`costs` with the draft forwards and every target pass wider than
  one token `factor` times as dear."""
  target = list(costs.target_ms)
  return dataclasses.replace(
      costs, target_ms=tuple(target[:1] + [t * factor for t in target[1:]]),
      draft_ms=costs.draft_ms * factor,
      first_draft_ms=costs.first_draft_ms * factor)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  sets = cost_sets()
  if not sets:
    raise app.UsageError("Give --costs or --runs.")
  alphas = _alphas(_ALPHAS.value)
  label = lambda a: ":".join(map(str, a)) if isinstance(a, tuple) else a
  print("costs | B | optimism | horizon | observe | margin | probe price | "
        "error | " + " | ".join(f"α = {label(a)}" for a in alphas))
  print(" | ".join("---" for _ in range(8 + len(alphas))))
  # (optimism, horizon, observe, margin, probe_price) -> every ratio it
  # scored.
  scores = {}
  for name, batch, costs in sets:
    batch = _BATCH.value or batch
    for optimism, horizon, observe, margin, price, error in (
        itertools.product(
            _floats(_OPTIMISM.value), _floats(_HORIZON.value),
            _floats(_OBSERVE.value), _floats(_MARGIN.value),
            _floats(_PROBE_PRICE.value), _floats(_ERROR.value))):
      policy = policies.Auto.from_costs(
          costs, optimism=optimism, horizon=int(horizon), margin=margin,
          probe_price=price)
      observe = bool(observe) and costs.draft_ms > 0
      # A policy that can never draft runs `generate` (no draft prefill).
      drafts = policy.may_draft()
      cells = []
      for a in alphas:
        starts = [(policy, 0)] + ([(simulate.settled(policy, a), 0),
                                   (policy, 1)] if _WARM.value else [])
        ratios = [simulate.over_best(
            p if drafts else None, costs, truth=scaled(costs, error),
            alpha=a, batch=batch,
            tokens=_TOKENS.value, samples=_SAMPLES.value,
            observe_first=observe and drafts, warm_after=after)
                  for p, after in starts]
        scores.setdefault((optimism, horizon, observe, margin, price),
                          []).append(ratios)
        cells.append(" / ".join(f"{r:.3f}" for r in ratios))
      print(f"{name} | {batch} | {optimism:g} | {horizon:g} | "
            f"{int(observe)} | {margin:g} | {price:g} | {error:g} | "
            + " | ".join(cells), flush=True)
  print("\noptimism | horizon | observe | margin | probe price | worst "
        "cell | mean cell")
  print(" | ".join("---" for _ in range(7)))
  for (optimism, horizon, observe, margin, price), ratios in (
      scores.items()):
    ratios = np.asarray(ratios)  # [cells, starts]
    worst, mean = (" / ".join(f"{r:.3f}" for r in f(ratios, 0))
                   for f in (np.min, np.mean))
    print(f"{optimism:g} | {horizon:g} | {int(observe)} | {margin:g} | "
          f"{price:g} | {worst} | {mean}")


if __name__ == "__main__":
  app.run(main)
