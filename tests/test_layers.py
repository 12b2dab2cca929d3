"""The library's structure: no import cycle, small modules, a declared core.

Imports are read from the source (every `import` and `from ... import`
statement, at module level or inside a function), so an import made at call
time to dodge a cycle counts like any other.
"""

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "specjax"


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for path in ROOT.rglob("*.py"):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = path
  return mods


def _imports(name: str, path: pathlib.Path, mods) -> set[str]:
  """The specjax modules `name` imports; importing `a.b.c` from outside
  package `a.b` also runs `a.b`'s `__init__`."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      targets = [f"{node.module}.{a.name}" for a in node.names]
      targets = [t if t in mods else node.module for t in targets]
    for target in targets:
      while target and target not in mods:
        target = target.rpartition(".")[0]
      if not target.startswith("specjax"):
        continue
      found.add(target)
      package = target.rpartition(".")[0]
      while package.startswith("specjax") and not (
          name == package or name.startswith(package + ".")):
        found.add(package)
        package = package.rpartition(".")[0]
  found.discard(name)
  return found


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle_among_specjax_modules():
  assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle():
  graph = collections.defaultdict(set, _graph())
  graph["specjax.verify"].add("specjax.decode")  # decode reaches verify
  assert any({"specjax.verify", "specjax.decode"} <= set(c)
             for c in _cycles(graph))


def test_a_call_time_import_counts(tmp_path):
  mods = {"specjax.a": tmp_path / "a.py", "specjax.b": tmp_path / "b.py"}
  mods["specjax.a"].write_text("def f():\n  from specjax import b\n")
  mods["specjax.b"].write_text("from specjax.a import f\n")
  graph = {n: _imports(n, p, mods) for n, p in mods.items()}
  assert _cycles(graph) == [["specjax.a", "specjax.b"]]


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_600_lines(path):
  assert len(path.read_text(encoding="utf-8").splitlines()) <= 600


def test_the_core_reads_no_undeclared_capability():
  """At most two getattr/hasattr calls in decode, speculate and verify
  together, each with a comment on the line before saying why."""
  calls = []
  for name in ("decode", "speculate", "verify"):
    lines = (ROOT / f"{name}.py").read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
      if "getattr(" in line or "hasattr(" in line:
        calls.append((name, i, lines[i - 1].strip().startswith("#")))
  assert len(calls) <= 2, calls
  assert all(commented for _, _, commented in calls), calls
