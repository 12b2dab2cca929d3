"""The generation controls and scores an experiment config names.

`generation_controls(config, tokenizer)` is the keywords every generate
call of an experiment gets, baseline and speculative alike (stop strings,
penalties, logit bias, min-p, a regex or a JSON schema); `make_scorer` what
completions are scored by (`experiments.quality`); `controls_info` the
record of both in results.json.
"""

from __future__ import annotations

import json
from typing import Any

from experiments import prompts as prompts_lib
from experiments import quality
from experiments.validation import ConfigError
from experiments.validation import grammar_fields
from experiments.validation import parse_logit_bias

__all__ = ["controls_info", "generation_controls", "make_scorer"]


def generation_controls(config: Any, tokenizer: Any) -> dict[str, Any]:
  """The generation-control keywords of `decode.generate` (and
  `speculative_generate`) a config sets: None where off."""
  regex, schema, _ = grammar_fields(config)
  return dict(
      stop=list(config.stop) or None,
      repetition_penalty=config.repetition_penalty,
      presence_penalty=config.presence_penalty,
      frequency_penalty=config.frequency_penalty,
      logit_bias=parse_logit_bias(config.logit_bias), min_p=config.min_p,
      regex=regex, json_schema=schema, tokenizer=tokenizer)


def make_scorer(config: Any, prompt_set: prompts_lib.PromptSet
                ) -> quality.Scorer:
  """What the config scores completions by (`experiments.quality`).

  Raises:
    ConfigError: pass@1 on prompts that are not HumanEval tasks (the
      built-in fallback set).
  """
  regex, _, scoring = grammar_fields(config)
  if config.pass_at_1:
    problems = quality.read_problems()
    missing = [p.id for p in prompt_set.prompts if p.id not in problems]
    if missing:
      raise ConfigError(
          f"config.pass_at_1: prompts {missing[:3]} of {prompt_set.source} "
          "are not HumanEval tasks (the wheel could not be read?).")
  return quality.Scorer(
      schema=json.loads(scoring) if scoring else None, regex=regex,
      humaneval=config.pass_at_1, chat=config.chat_template,
      timeout=config.pass_at_1_timeout)


def controls_info(config: Any) -> dict[str, Any]:
  """The generation controls a run used, for results.json and the report
  (the grammar by its source: a regex or the JSON schema's text)."""
  regex, schema, scoring = grammar_fields(config)
  info = {k: config[k] for k in ("repetition_penalty", "presence_penalty",
                                 "frequency_penalty", "min_p")
          if config[k] is not None}
  if config.stop:
    info["stop"] = list(config.stop)
  if config.logit_bias:
    info["logit_bias"] = parse_logit_bias(config.logit_bias)
  if regex:
    info["regex"] = regex
  if schema:
    info["json_schema"] = schema
  if scoring:
    info["scoring_schema"] = scoring
  return info
