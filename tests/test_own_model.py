"""Runs docs/api.md's "Use from your own model" snippet, the drafter
snippet of docs/drafters.md after it, and docs/nnx_gemma.md.

The model snippet is the first fenced `python` block under the heading
`## Use from your own model` in docs/api.md. It wraps a Flax GRU language
model (not a specjax transformer) in a `LanguageModel` adapter, decodes with
`speculative_generate` and asserts greedy equality with `generate`, so a
protocol change that breaks user models fails here. The drafter snippet,
the first block under `## The protocol: ...` in docs/drafters.md, run after
it in the same namespace, writes a `Drafter` subclass against the declared
protocol and drafts with it for the GRU target. The NNX page's block loads
a Gemma 3 checkpoint into a Flax NNX model of its own and into specjax's
Gemma forward, and speculates with each drafting for the other.
"""

from __future__ import annotations

import pathlib
import re
import sys
import types

import pytest

import specjax.drafters

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = (ROOT / "docs" / "api.md", "## Use from your own model")
DRAFTER = (ROOT / "docs" / "drafters.md",
           "## The protocol: `specjax.drafters.Drafter`")
NNX = (ROOT / "docs" / "nnx_gemma.md", "# Another JAX project's model: a "
       "Flax NNX Gemma 3 through `specjax.decode`")


def _section(text: str, heading: str) -> str:
  """The lines after `heading` up to the next level-1/2 heading."""
  lines = text.splitlines(keepends=True)
  start = next(i for i, l in enumerate(lines) if l.rstrip() == heading) + 1
  fenced = False
  for end in range(start, len(lines)):
    if lines[end].startswith("```"):
      fenced = not fenced
    elif not fenced and re.match(r"#{1,2} ", lines[end]):
      break
  else:
    end = len(lines)
  return "".join(lines[start:end])


def snippet(where: tuple[pathlib.Path, str] = MODEL
            ) -> tuple[str, pathlib.Path]:
  """(code of the first python block under `where`'s heading, its file)."""
  source, heading = where
  blocks = re.findall(r"^```python\n(.*?)^```", _section(
      source.read_text("utf-8"), heading), flags=re.MULTILINE | re.DOTALL)
  assert blocks, f"No ```python block under {heading!r} in {source}."
  return blocks[0], source


def _run(codes: list[str], source: pathlib.Path) -> dict:
  """Runs `codes` one after another in one namespace, returned."""
  # Run them as a module of their own, as a user's file would be (dataclasses
  # look their module up in sys.modules), without this file's __future__
  # imports.
  module = types.ModuleType("readme_snippet")
  module.__file__ = str(source)
  sys.modules[module.__name__] = module
  try:
    for code in codes:
      compiled = compile(code, str(source), "exec", dont_inherit=True)
      exec(compiled, module.__dict__)  # pylint: disable=exec-used
  finally:
    del sys.modules[module.__name__]
  return module.__dict__


@pytest.mark.parametrize("where", [MODEL, DRAFTER, NNX],
                         ids=["model", "drafter", "nnx"])
def test_snippet_ends_with_an_assert(where):
  code, source = snippet(where)
  last = [l for l in code.splitlines() if l.strip()][-1]
  assert last.startswith("assert "), (
      f"The snippet in {source} should end by asserting its result.")


def test_own_model_snippet_runs():
  code, source = snippet()
  namespace = _run([code], source)
  # It really decoded with a non-specjax model on both sides.
  out, ref = namespace["out"], namespace["ref"]
  assert out.tokens.shape == ref.tokens.shape == (2, 12)
  for role in ("target", "draft"):
    assert type(namespace[role]).__module__ == "readme_snippet", role
  assert int(out.stats.steps) >= 1


def test_own_drafter_snippet_runs():
  (model, source), (drafter_code, _) = snippet(MODEL), snippet(DRAFTER)
  namespace = _run([model, drafter_code], source)
  drafter, out, ref = namespace["drafter"], namespace["out"], namespace["ref"]
  # A user's own Drafter subclass drafted for the user's own target.
  assert isinstance(drafter, specjax.drafters.Drafter)
  assert type(drafter).__module__ == "readme_snippet"
  assert out.tokens.shape == ref.tokens.shape == (2, 12)
  assert int(out.stats.steps) >= 1
  assert int(out.stats.proposed.sum()) > 0  # it proposed drafts


def test_nnx_gemma_snippet_runs(hf_checkpoint, monkeypatch):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  directory, _ = hf_checkpoint("gemma3")  # transformers' tiny random Gemma 3
  monkeypatch.setenv("GEMMA3_CHECKPOINT", directory)
  code, source = snippet(NNX)
  namespace = _run([code], source)
  # An NNX module of the page's own on each side of a speculation.
  for name in ("nnx_gemma", "nnx_draft"):
    module = nnx.merge(namespace[name].graph, namespace[name].state)
    assert isinstance(module, nnx.Module), name
    assert type(module).__module__ == "readme_snippet", name
  out, back = namespace["out"], namespace["back"]
  assert out.tokens.shape == back.tokens.shape == (2, 16)
  # specjax's forward drafted exactly the NNX model's greedy tokens at every
  # position (the two implementations agree), while the random NNX draft
  # was rejected somewhere, so the NNX cache was rolled back.
  from_specjax, from_nnx = namespace["alpha"]
  assert from_specjax == 1.0
  assert 0.0 < from_nnx < 1.0
