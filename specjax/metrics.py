"""Speculative-decoding metrics from `SpecStats` (DESIGN.md definitions).

- α `acceptance_rate`: accepted draft tokens / proposed draft tokens.
- τ `mean_accepted_tokens`: tokens emitted per target forward (accepted + 1),
  averaged over (row, step) pairs.
- `per_position_acceptance[i]`: of the steps that proposed draft position i,
  the fraction in which it was accepted (so it includes every earlier
  position being accepted).
- `predicted_speedup` (Leviathan et al. 2023): (1 - α^(γ+1)) / ((1 - α)(γc + 1))
  for a measured cost ratio c = draft forward time / target forward time.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def acceptance_rate(stats: Any) -> float:
  proposed = int(np.sum(stats.proposed_by_position))
  accepted = int(np.sum(stats.accepted_by_position))
  return accepted / proposed if proposed else float("nan")


def mean_accepted_tokens(stats: Any) -> float:
  accepted = np.asarray(stats.accepted)
  ran = accepted >= 0
  return float(np.mean(accepted[ran] + 1)) if ran.any() else float("nan")


def per_position_acceptance(stats: Any) -> list[float]:
  acc = np.asarray(stats.accepted_by_position, np.float64)
  prop = np.asarray(stats.proposed_by_position, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    return [float(x) for x in np.where(prop > 0, acc / prop, np.nan)]


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
  """Leviathan et al.'s expected walltime improvement for α, γ and c."""
  if alpha >= 1.0:
    tokens_per_step = gamma + 1.0
  else:
    tokens_per_step = (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
  return tokens_per_step / (gamma * cost_ratio + 1.0)


def summarize(stats: Any, gamma: int,
              cost_ratio: float | None = None) -> dict[str, Any]:
  """All metrics of one speculative run as a JSON-ready dict."""
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
      "draft_forwards": int(stats.draft_forwards),
  }
  if cost_ratio is not None:
    out["draft_cost_ratio"] = cost_ratio
    out["predicted_speedup"] = predicted_speedup(alpha, gamma, cost_ratio)
  return out
