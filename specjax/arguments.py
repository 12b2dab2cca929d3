"""Checks of the decoders' arguments, and the γ policy a `gamma` names.

Shape letters (`specjax.shapes`): B batch, S cache size, G = γ.

Each check fails early with a message that names the argument and what it
must be (`tests/test_api_errors.py`); prompts and N are checked where they
are padded (`specjax.padding.prompt_rows`, `check_max_new_tokens`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from specjax import policies
from specjax.acceptance import Acceptance
from specjax.drafters import Drafter
from specjax.models import LanguageModel

__all__ = ["check_eos", "check_model", "check_tree", "gamma_bound",
           "policy_name", "resolve_policy"]


def check_model(model: Any, name: str, drafter_too: bool = False) -> None:
  """A clear error for a `model` argument that is not a `LanguageModel`
  (or, with `drafter_too`, a `Drafter` either)."""
  kinds = (Drafter, LanguageModel) if drafter_too else (LanguageModel,)
  if isinstance(model, kinds):
    return
  hint = (" (a name or path: load it first, e.g. "
          "specjax.registry.load_pretrained)"
          if isinstance(model, (str, bytes)) else "")
  wanted = ("a specjax.models.LanguageModel or a specjax.drafters.Drafter "
            "subclass" if drafter_too else "a specjax.models.LanguageModel "
            "(vocab_size, init_cache, __call__, prefill)")
  raise TypeError(f"{name} must be {wanted}, got {type(model).__name__} "
                  f"{model!r:.60}{hint}.")


def check_eos(eos_id: int | Sequence[int] | None, vocab_size: int) -> None:
  """EOS ids must be token ids of the model's vocabulary."""
  ids = [] if eos_id is None else (
      [eos_id] if isinstance(eos_id, (int, np.integer)) else list(eos_id))
  bad = [i for i in ids if not 0 <= int(i) < vocab_size]
  if bad:
    raise ValueError(f"eos_id {bad} outside the vocabulary [0, "
                     f"{vocab_size}).")


def gamma_bound(gamma: int | str | policies.GammaPolicy, *,
                max_gamma: int) -> int:
  """G, the most drafts a step may verify, for a `gamma` argument
  (validated)."""
  if isinstance(gamma, policies.GammaPolicy):
    return gamma.max_gamma
  if isinstance(gamma, str):
    if gamma in ("auto", "heuristic"):
      return max_gamma
  elif not isinstance(gamma, bool) and int(gamma) == gamma and gamma >= 1:
    return int(gamma)
  raise ValueError(f"gamma must be an integer >= 1, 'auto' or "
                   f"'heuristic', got {gamma!r}.")


def resolve_policy(gamma: int | str | policies.GammaPolicy, *,
                   max_gamma: int, target: LanguageModel, drafter: Drafter,
                   batch: int, cache_size: int,
                   num_nodes: int | None = None) -> policies.GammaPolicy:
  """The γ policy for a `gamma` argument.

  An int is `Fixed(gamma)` (with `num_nodes`, a token tree); "heuristic"
  is `Heuristic(max_gamma)`; "auto" is `Auto` priced for B = `batch` and S
  = `cache_size` by `StepCosts.for_call` (the tuning step's tables, else
  the roofline: nothing is timed); a `GammaPolicy` is used as is.

  Raises:
    ValueError: an invalid `gamma`.
  """
  gamma_bound(gamma, max_gamma=max_gamma)  # validates
  if isinstance(gamma, policies.GammaPolicy):
    return gamma
  if gamma == "heuristic":
    return policies.Heuristic(max_gamma)
  if gamma == "auto":
    return policies.Auto.from_costs(policies.StepCosts.for_call(
        target, drafter.cost_model, batch=batch, cache_size=cache_size,
        max_gamma=max_gamma))
  return policies.Fixed(int(gamma), num_nodes)


def check_tree(num_nodes: int | None, gamma: int,
               requested: int | str | policies.GammaPolicy,
               drafter: Drafter, acceptance: Acceptance) -> None:
  """Errors for `num_nodes` with G = `gamma` and the `gamma` argument as
  `requested` (an int, or an adaptive policy or its name)."""
  if num_nodes is None:
    return
  if isinstance(num_nodes, bool) or int(num_nodes) != num_nodes or (
      num_nodes < gamma):
    raise ValueError(f"num_nodes must be an integer >= gamma={gamma} (one "
                     f"node per depth at least), got {num_nodes!r}.")
  if isinstance(requested, (str, policies.GammaPolicy)):
    name = (requested if isinstance(requested, str)
            else policy_name(requested))
    raise ValueError("num_nodes (token trees) takes a fixed integer gamma, "
                     f"not an adaptive policy ({name}).")
  if not drafter.supports_trees:
    raise ValueError(f"{type(drafter).__name__} drafts chains only; token "
                     "trees (num_nodes) need a tree drafter: DraftModel or "
                     "PromptLookup.")
  if not acceptance.walks_trees:
    raise ValueError(f"{type(acceptance).__name__} acceptance verifies "
                     "chains only; token trees (num_nodes) use exact or "
                     "synthetic acceptance.")


def policy_name(policy: policies.GammaPolicy, prefix: str = "") -> str:
  """"" for a fixed γ, else the policy's name ("auto", "heuristic")."""
  if isinstance(policy, policies.Fixed):
    return ""
  return prefix + type(policy).__name__.lower()
