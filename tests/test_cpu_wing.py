"""The CPU wing (`specjax.cpu`) stands apart from the engine.

The engine, every specjax module but the wing and the loaders below,
imports nothing from the wing: not directly, not inside a function, and
not through another module it imports. The model reaches the kernels only
through its matmul seam, a plan's `MatmulKernel` (`specjax.models.kernel`),
which the loaders take from the wing and hand to it. Imports are read from
the source with `test_layers`'s reader.
"""

import dataclasses

import pytest

from specjax import cpu
from specjax.cpu import kernels
from specjax.models import MatmulKernel
from specjax.models import MatmulPlan
from specjax.models import quantized
from test_layers import _graph
from test_layers import _imports

WING = "specjax.cpu"
# The loader layer: modules that choose a plan or a weight format in the
# wing and hand it to the model, and the applications built on them.
LOADERS = frozenset({
    "specjax.registry",  # load_pretrained: matmul= and quantize="auto"
    "specjax.tune",  # python -m specjax.tune loads through the registry
    "specjax.testing",  # random_model gets this machine's plan
    "specjax.heads.pipeline",  # a training run loads its target
    "specjax.aot.report",  # real shapes from specjax.testing
    "specjax.aot.crossover",  # the report's models at each B
})


def _in_wing(name: str) -> bool:
  return name == WING or name.startswith(WING + ".")


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
  """Every module `start` imports, directly or through others."""
  seen, todo = set(), [start]
  while todo:
    for name in graph.get(todo.pop(), ()):
      if name not in seen:
        seen.add(name)
        todo.append(name)
  return seen


def engine(graph: dict[str, set[str]]) -> list[str]:
  """The engine: every module but the wing's and the loaders."""
  return sorted(n for n in graph if not _in_wing(n) and n not in LOADERS)


def wing_reached(graph: dict[str, set[str]]) -> dict[str, list[str]]:
  """Engine module -> the wing's modules it reaches (none, if all is well)."""
  found = {n: sorted(filter(_in_wing, _reached(graph, n)))
           for n in engine(graph)}
  return {n: wing for n, wing in found.items() if wing}


def test_the_engine_imports_nothing_from_the_wing():
  graph = _graph()
  assert "specjax.decode" in engine(graph)
  assert "specjax.models.transformer" in engine(graph)
  assert wing_reached(graph) == {}


def test_each_loader_reaches_the_wing():
  """The list names modules that exist and need the wing, so it cannot
  hide an engine module."""
  graph = _graph()
  assert LOADERS <= set(graph)
  for name in sorted(LOADERS):
    assert any(map(_in_wing, _reached(graph, name))), name


def test_only_the_wing_imports_its_kernels():
  graph = _graph()
  importers = {n for n, deps in graph.items() if f"{WING}.kernels" in deps}
  assert importers and all(map(_in_wing, importers)), importers


@pytest.mark.parametrize("source", [
    "def f():\n  from specjax.cpu import kernels\n",
    "def f():\n  import specjax.cpu.plans\n",
    "from specjax import helper\n",  # which imports the wing
])
def test_the_check_finds_a_wing_import(tmp_path, source):
  mods = {name: tmp_path / f"{name}.py" for name in (
      "specjax.decode", "specjax.helper", "specjax.cpu",
      "specjax.cpu.kernels", "specjax.cpu.plans")}
  for path in mods.values():
    path.write_text("")
  mods["specjax.helper"].write_text("from specjax.cpu import plans\n")
  mods["specjax.decode"].write_text(source)
  graph = {n: _imports(n, p, mods) for n, p in mods.items()}
  assert "specjax.decode" in wing_reached(graph)


def test_a_plan_carries_the_wings_kernel():
  plan = cpu.plan("out_in/hybrid")
  assert isinstance(cpu.SMALLM, MatmulKernel) and plan.kernel is cpu.SMALLM
  assert plan == cpu.plan("out_in/hybrid") and hash(plan) == hash(
      cpu.plan("out_in/hybrid"))
  assert cpu.plan("out_in/xla") == MatmulPlan.parse("out_in/xla")
  # The engine drops a kernel this way (`sharding.shard`).
  assert dataclasses.replace(plan, kernel=False).kernel is None
  with pytest.raises(ValueError, match=r"specjax\.cpu\.plan"):
    MatmulPlan.parse("out_in/kernel")
  with pytest.raises(TypeError, match="MatmulKernel"):
    MatmulPlan(layout="out_in", kernel=True)
  # The model's int8 activations are chunked as the kernels read them.
  assert quantized.ACT_CHUNK == kernels.ACT_CHUNK
