"""Validation of experiment configs, before anything is loaded or compiled.

Every error names the config field (`config.gamma must be an integer >= 1,
got 0.`), and all invalid fields are reported at once.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from experiments import prompts as prompts_lib
from specjax.models import quantized
from specjax.tuning import matmul as tuning

__all__ = ["ConfigError", "DTYPES", "validate_config"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
# `early_exit@E` drafts with the target's first E layers (`early_exit`:
# `config.exit_layer`); `layer_skip` with all but `config.skip_layers`.
# `medusa` and `eagle` draft with heads trained by `experiments.train_heads`,
# read from `config.medusa_path` / `config.eagle_path`.
DRAFTERS = ("model", "lookup", "fallback", "cascade", "early_exit",
            "layer_skip", "medusa", "eagle")
POLICIES = ("auto", "heuristic")
# Drafters that grow token trees; the others run chains only in a sweep.
TREE_DRAFTERS = ("model", "lookup", "early_exit", "layer_skip")


class ConfigError(ValueError):
  """An invalid experiment config; the message names each bad field."""


def drafter_kind(name: str) -> tuple[str, int | None]:
  """A drafter name as (kind in DRAFTERS, exit layer or None): `model`
  -> ("model", None), `early_exit@8` -> ("early_exit", 8).

  Raises:
    ConfigError: an unknown name, or an exit layer that is not a positive
      integer.
  """
  kind, at, layer = name.partition("@")
  if kind not in DRAFTERS or (at and (kind != "early_exit"
                                      or not layer.isdigit()
                                      or int(layer) < 1)):
    raise ConfigError(f"drafter {name!r} is not one of {DRAFTERS} or "
                      "early_exit@E with an exit layer E >= 1.")
  return kind, int(layer) if at else None


# ------------------------------------------------------------- validation


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
  return (isinstance(x, (int, float, np.number)) and not isinstance(x, bool)
          and math.isfinite(float(x)))


def _looks_like_path(name: str) -> bool:
  return (os.path.isabs(name) or name.startswith(("./", "../", "~"))
          or name in (".", ".."))


def _model_errors(field: str, name: Any) -> list[str]:
  if not isinstance(name, str) or not name:
    return [f"config.{field} must be a model name or path, got {name!r}."]
  if _looks_like_path(name) and not os.path.exists(os.path.expanduser(name)):
    return [f"config.{field}: local path {name!r} does not exist."]
  return []


def parse_mesh(text: str) -> tuple[int, int] | None:
  """'2x4' -> (2, 4) (data, model); None when malformed."""
  parts = str(text).split("x")
  if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
    return None
  return int(parts[0]), int(parts[1])


def validate_config(config: Any) -> None:
  """Checks every field an experiment reads, before anything is loaded.

  Args:
    config: an experiment config (see `configs/llama_pair.py`).

  Raises:
    ConfigError: listing every invalid field as `config.<field> ...`.
  """
  errors = []

  def check(ok: bool, message: str) -> None:
    if not ok:
      errors.append(message)

  errors += _model_errors("target", config.target)
  errors += _model_errors("draft", config.draft)
  if config.target == "tiny":
    check(config.draft in ("tiny", "same"),
          f"config.draft must be 'tiny' or 'same' when config.target is "
          f"'tiny' (random models have no real tokenizer), got "
          f"{config.draft!r}.")
  elif config.draft == "tiny":
    check(False, "config.draft is 'tiny' but config.target is "
          f"{config.target!r}; a random tiny draft only pairs with "
          "target='tiny'.")
  check(config.target != "same",
        "config.target cannot be 'same' (only the draft can).")
  check(config.dtype in DTYPES,
        f"config.dtype must be one of {DTYPES}, got {config.dtype!r}.")
  for field, names in (("drafter", (config.drafter,)),
                       ("drafters", tuple(config.get("drafters", ())))):
    for name in names:
      try:
        drafter_kind(name)
      except ConfigError:
        check(False, f"config.{field} must name drafters in {DRAFTERS} "
              f"(or early_exit@E, E >= 1), got {name!r}.")
  for kind in sorted({"medusa", "eagle"} & set(
      (config.drafter,) + tuple(config.get("drafters", ())))):
    check(bool(config.get(f"{kind}_path")),
          f"drafter {kind!r} needs config.{kind}_path: the workdir of "
          f"`python -m experiments.train_heads` (kind={kind}).")
  exit_layer = config.get("exit_layer", 0)
  check(_is_int(exit_layer) and exit_layer >= 0,
        f"config.exit_layer must be an integer >= 0 (0: half the target's "
        f"layers), got {exit_layer!r}.")
  bad = [p for p in config.get("policies", ()) if p not in POLICIES]
  check(not bad, f"config.policies must name policies in {POLICIES}, got "
        f"{bad}.")
  max_gamma = config.get("max_gamma", 1)
  check(_is_int(max_gamma) and max_gamma >= 1,
        f"config.max_gamma must be an integer >= 1, got {max_gamma!r}.")
  nodes = (config.get("num_nodes", 0),) + tuple(
      config.get("num_nodes_sweep", ()))
  check(all(_is_int(n) and n >= 0 for n in nodes),
        f"config.num_nodes and num_nodes_sweep must be integers >= 0 (0: "
        f"chains), got {nodes!r}.")
  if any(nodes):
    gammas = tuple(config.gammas) or (config.gamma,)
    small = [n for n in nodes if 0 < n < max(gammas)]
    check(not small, f"config.num_nodes values {small} are below gamma="
          f"{max(gammas)}: a tree needs a node per depth at least.")
    names = tuple(config.get("drafters", ())) or (config.drafter,)
    check(any(d.partition("@")[0] in TREE_DRAFTERS for d in names),
          f"token trees (config.num_nodes) need one of {TREE_DRAFTERS};"
          f" {list(names)} draft chains only.")
  inner = config.get("cascade_gamma", 1)
  check(_is_int(inner) and inner >= 1,
        f"config.cascade_gamma must be an integer >= 1, got {inner!r}.")
  check(config.matmul == "auto" or config.matmul in tuning.PLANS,
        f"config.matmul must be 'auto' or one of {tuning.PLANS}, got "
        f"{config.matmul!r}.")
  for name in ("quantize", "draft_quantize"):
    value = config.get(name, "")
    try:
      quantized.parse(value or None)
    except ValueError as e:
      check(False, f"config.{name}={value!r}: {e}")
  for name in ("gamma", "batch_size"):
    value = config[name]
    check(_is_int(value) and value >= 1,
          f"config.{name} must be an integer >= 1, got {value!r}.")
  for name in ("gammas", "batch_sizes"):
    value = config[name]
    check(isinstance(value, (tuple, list))
          and all(_is_int(v) and v >= 1 for v in value),
          f"config.{name} must be a tuple of integers >= 1 (empty: no "
          f"sweep), got {value!r}.")
  check(_is_num(config.temperature) and config.temperature >= 0,
        f"config.temperature must be >= 0 (0 is greedy), got "
        f"{config.temperature!r}.")
  check(_is_int(config.top_k) and config.top_k >= 0,
        f"config.top_k must be an integer >= 0 (0 disables), got "
        f"{config.top_k!r}.")
  check(_is_num(config.top_p) and 0 < config.top_p <= 1,
        f"config.top_p must be in (0, 1], got {config.top_p!r}.")
  check(_is_int(config.seed), f"config.seed must be an integer, got "
        f"{config.seed!r}.")
  check(_is_num(config.draft_stop_threshold)
        and 0 <= config.draft_stop_threshold <= 1,
        f"config.draft_stop_threshold must be in [0, 1], got "
        f"{config.draft_stop_threshold!r}.")
  rate = config.synthetic_acceptance
  check(rate is None or (_is_num(rate) and 0 <= rate <= 1),
        f"config.synthetic_acceptance must be None or in [0, 1], got "
        f"{rate!r}.")
  check(not config.prompt_file or os.path.isfile(
      os.path.expanduser(config.prompt_file)),
        f"config.prompt_file {config.prompt_file!r} does not exist.")
  check(config.prompt_set in prompts_lib.PROMPT_SETS,
        f"config.prompt_set must be one of {prompts_lib.PROMPT_SETS}, got "
        f"{config.prompt_set!r}.")
  for name, low in (("num_prompts", 1), ("max_new_tokens", 1),
                    ("max_prompt_tokens", 0), ("timing_repeats", 1),
                    ("cost_repeats", 1)):
    value = config[name]
    check(_is_int(value) and value >= low,
          f"config.{name} must be an integer >= {low}, got {value!r}.")
  for name in ("chat_template", "ignore_eos", "plots", "progress",
               "save_text"):
    check(isinstance(config[name], bool),
          f"config.{name} must be a boolean, got {config[name]!r}.")
  mesh = config.get("mesh", "")
  check(mesh == "" or parse_mesh(mesh) is not None,
        f"config.mesh must be '' (one device) or DATAxMODEL with positive "
        f"integers, e.g. '1x2', got {mesh!r}.")
  check(isinstance(config.get("draft_split", False), bool),
        f"config.draft_split must be a boolean, got "
        f"{config.get('draft_split')!r}.")
  check(isinstance(config.output_dir, str) and bool(config.output_dir),
        f"config.output_dir must be a non-empty path, got "
        f"{config.output_dir!r}.")
  if errors:
    raise ConfigError("Invalid experiment config:\n  " + "\n  ".join(errors))
