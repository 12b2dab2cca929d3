"""Speculative-decoding metrics from `SpecStats`.

- α `acceptance_rate`: accepted draft tokens / proposed draft tokens.
- τ `mean_accepted_tokens`: tokens emitted per target forward (accepted + 1),
  averaged over (row, step) pairs.
- `per_position_acceptance[i]`: of the steps that proposed draft position i,
  the fraction in which it was accepted (so it includes every earlier
  position being accepted).
- `predicted_speedup` (Leviathan et al. 2023):
  (1 - α^(γ+1)) / ((1 - α)(γc + r))
  for a measured cost ratio c = draft forward time / target forward time and
  r = verification pass time / target forward time (1 in the paper).

- `predicted_speedup_extended` (the same, for any drafter): with
  d_i = P(position i is drafted) (`drafted_fraction`, from the proposed
  counts per position), E[tokens per step] = 1 + Σ_i d_i α^(i+1), and
  speedup = E[tokens per step] / (Σ_k c_k f_k + r), where f_k is the
  forwards of drafter component k per step (`Drafter.components`) and c_k
  its cost per target forward (0 for prompt lookup). With d_i = 1 and one
  model component (f = γ) this is Leviathan's formula.

Every function takes `SpecStats` (or numpy arrays of it); `row` restricts a
metric to one batch row. `summarize(out)` takes a whole `SpecOutput`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from specjax.outputs import SpecOutput
from specjax.policies.costs import expected_tokens


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
  """The first index where token sequences a and b differ: the shorter
  one's length when it is a prefix of the other, None when they are
  equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def _steps_run(stats: Any, row: int | None) -> np.ndarray:
  """Accepted counts of the (row, step) pairs that ran."""
  accepted = np.asarray(stats.accepted)
  if row is not None:
    accepted = accepted[row]
  return accepted[accepted >= 0]


def acceptance_rate(stats: Any, row: int | None = None) -> float:
  """α: accepted / proposed draft tokens (of one row, or all)."""
  if row is None:
    proposed = int(np.sum(stats.proposed_by_position))
    accepted = int(np.sum(stats.accepted_by_position))
  else:
    proposed = int(np.asarray(stats.proposed)[row])
    accepted = int(np.sum(_steps_run(stats, row)))
  return accepted / proposed if proposed else float("nan")


def mean_accepted_tokens(stats: Any, row: int | None = None) -> float:
  """τ: tokens emitted per target pass, over the (row, step) pairs run."""
  ran = _steps_run(stats, row)
  return float(np.mean(ran + 1)) if ran.size else float("nan")


def num_steps(stats: Any, row: int) -> int:
  """Speculative steps row `row` took part in."""
  return int(_steps_run(stats, row).size)


def per_position_acceptance(stats: Any) -> list[float]:
  acc = np.asarray(stats.accepted_by_position, np.float64)
  prop = np.asarray(stats.proposed_by_position, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    return [float(x) for x in np.where(prop > 0, acc / prop, np.nan)]


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float,
                      verify_ratio: float = 1.0) -> float:
  """Leviathan et al.'s expected walltime improvement for α, γ and c, with
  the verification pass costing `verify_ratio` target forwards (the paper
  assumes 1; `specjax.tuning.cost` measures it)."""
  return (expected_tokens([alpha] * gamma, gamma)
          / (gamma * cost_ratio + verify_ratio))


def experts_per_pass(stats: Any, num_layers: int = 1) -> float | None:
  """Distinct experts a verification pass of a mixture-of-experts target
  woke, per layer and pass (over `num_layers`); None for a dense target
  or no pass. A decode step wakes k; a pass of T tokens up to min(T·k,
  X)."""
  passes = int(getattr(stats, "expert_passes", 0))
  if not passes:
    return None
  return float(stats.experts) / passes / num_layers


def drafted_fraction(stats: Any) -> list[float]:
  """d_i: the fraction of (row, step) pairs that drafted position i."""
  pairs = np.sum(np.asarray(stats.accepted) >= 0)
  prop = np.asarray(stats.proposed_by_position, np.float64)
  return [float(x) for x in prop / max(int(pairs), 1)]


def drafting_cost_per_step(stats: Any,
                           component_costs: Sequence[float]) -> float:
  """Σ_k c_k f_k: drafting cost per speculative step in target forwards,
  from the forwards of each drafter component per loop step (they run once
  for the whole batch; prefill included) and their costs `component_costs`.
  """
  forwards = np.asarray(stats.draft_forwards, np.float64).reshape(-1)
  return float(np.dot(np.asarray(component_costs, np.float64), forwards)
               / max(int(np.sum(stats.steps)), 1))


def predicted_speedup_extended(stats: Any, component_costs: Sequence[float],
                               verify_ratio: float = 1.0) -> float:
  """Leviathan's prediction for any drafter (module docstring): measured α,
  drafted fractions d_i, and forwards per step of each drafter component,
  weighted by `component_costs` (c_k, one per component)."""
  alpha = acceptance_rate(stats)
  tokens = 1.0 + sum(d * alpha ** (i + 1)
                     for i, d in enumerate(drafted_fraction(stats)))
  return tokens / (drafting_cost_per_step(stats, component_costs)
                   + verify_ratio)


def summarize(result: SpecOutput | Any, gamma: int | None = None,
              cost_ratio: float | None = None) -> dict[str, Any]:
  """All metrics of one speculative run as a JSON-ready dict.

  Args:
    result: the run's `SpecOutput` (it holds the stats and γ), or its
      `SpecStats` (then pass `gamma`).
    gamma: γ (γ_max under an adaptive policy); default the output's.
    cost_ratio: c, a measured draft / target forward time; with it the
      dict adds Leviathan et al.'s `predicted_speedup`.

  Raises:
    TypeError: `SpecStats` without `gamma`.
  """
  extra = {}
  if isinstance(result, SpecOutput):
    gamma = result.gamma if gamma is None else gamma
    extra = {"policy": result.policy, "synthetic": result.synthetic,
             "lossless": result.lossless}
    stats = result.stats
  elif gamma is None:
    raise TypeError("summarize(stats) needs gamma=; or pass the SpecOutput "
                    "itself, which holds it.")
  else:
    stats = result
  alpha = acceptance_rate(stats)
  out = {
      "gamma": gamma,
      "acceptance_rate": alpha,
      "mean_accepted_tokens": mean_accepted_tokens(stats),
      "per_position_acceptance": per_position_acceptance(stats),
      "proposed_tokens": int(np.sum(stats.proposed_by_position)),
      "accepted_tokens": int(np.sum(stats.accepted_by_position)),
      "steps": int(stats.steps),
      "target_forwards": int(stats.target_forwards),
      "draft_forwards": int(np.sum(stats.draft_forwards)),
      "draft_forwards_by_component": np.asarray(
          stats.draft_forwards).reshape(-1).tolist(),
      # Summed over layers; per layer: experts_per_pass(stats, L).
      "experts_per_pass_all_layers": experts_per_pass(stats),
      **extra,
  }
  if cost_ratio is not None:
    out["draft_cost_ratio"] = cost_ratio
    out["predicted_speedup"] = predicted_speedup(alpha, gamma, cost_ratio)
  return out
