"""Runs the README's "Use from your own model" snippet.

The snippet is the first fenced `python` block under the heading
`## Use from your own model` in README.md. It wraps a Flax GRU language model (not a
specjax transformer) in a `LanguageModel` adapter, decodes with
`speculative_generate` and asserts greedy equality with `generate`, so a
protocol change that breaks user models fails here.
"""

from __future__ import annotations

import pathlib
import re
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADING = "## Use from your own model"


def _section(text: str) -> str:
  """The lines after HEADING up to the next level-1/2 heading."""
  lines = text.splitlines(keepends=True)
  start = next(i for i, l in enumerate(lines) if l.rstrip() == HEADING) + 1
  fenced = False
  for end in range(start, len(lines)):
    if lines[end].startswith("```"):
      fenced = not fenced
    elif not fenced and re.match(r"#{1,2} ", lines[end]):
      break
  else:
    end = len(lines)
  return "".join(lines[start:end])


def snippet() -> tuple[str, pathlib.Path]:
  """(code of the first python block in the section, the file it came from)."""
  source = ROOT / "README.md"
  blocks = re.findall(r"^```python\n(.*?)^```", _section(
      source.read_text("utf-8")), flags=re.MULTILINE | re.DOTALL)
  assert blocks, f"No ```python block under {HEADING!r} in {source}."
  return blocks[0], source


def test_snippet_ends_with_an_assert():
  code, source = snippet()
  last = [l for l in code.splitlines() if l.strip()][-1]
  assert last.startswith("assert "), (
      f"The snippet in {source} should end by asserting its result.")


def test_own_model_snippet_runs():
  code, source = snippet()
  # Run it as a module of its own, as a user's file would be (dataclasses look
  # their module up in sys.modules), without this file's __future__ imports.
  module = types.ModuleType("readme_snippet")
  module.__file__ = str(source)
  sys.modules[module.__name__] = module
  try:
    compiled = compile(code, str(source), "exec", dont_inherit=True)
    exec(compiled, module.__dict__)  # pylint: disable=exec-used
  finally:
    del sys.modules[module.__name__]
  namespace = module.__dict__
  # It really decoded with a non-specjax model on both sides.
  out, ref = namespace["out"], namespace["ref"]
  assert out.tokens.shape == ref.tokens.shape == (2, 12)
  for role in ("target", "draft"):
    assert type(namespace[role]).__module__ == "readme_snippet", role
  assert int(out.stats.steps) >= 1
