"""Executes the Colab notebooks top to bottom, as CI would.

Each notebook runs in a fresh `python3` kernel (jupyter_client substitutes
the running interpreter for a kernel spec's bare `python`, so this
interpreter's packages are the ones imported) with
`SPECJAX_NOTEBOOK_PAIR=tiny` (the random tiny pair: no downloads), the Agg
matplotlib backend, this checkout first on `PYTHONPATH` (the notebooks import
`experiments` and `configs` as well as `specjax`), and a temporary working
directory. Both notebooks run concurrently (mostly XLA compilation, which
leaves CPU idle); a cell that raises or runs past `CELL_TIMEOUT_S` fails that
notebook. The notebooks assert their own invariants (greedy speculative
output equals autoregressive output, the rejection sampler reproduces p).
They are saved with the outputs of such a run (`scripts/save_notebooks.py`),
which the cheap tests check are complete and small.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import re
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = ("quickstart.ipynb", "anatomy.ipynb")
CELL_TIMEOUT_S = 300  # one cell, compilation on a slow shared CPU included
MAX_SAVED_BYTES = 1 << 20  # a saved notebook, its outputs included


@dataclasses.dataclass
class Executed:
  """One notebook after execution.

  Attributes:
    nb: the notebook, outputs filled in.
    error: what stopped it, or None.
    seconds: wall time, kernel start included.
  """

  nb: object
  error: BaseException | None
  seconds: float


def _read(name: str):
  return nbformat.read(COLAB / name, as_version=4)


def _outputs(nb, key: str):
  for cell in nb.cells:
    if cell.cell_type == "code":
      for out in cell.outputs:
        yield out.get(key)


async def _execute(name: str, cwd: pathlib.Path, env: dict) -> Executed:
  cwd.mkdir(parents=True, exist_ok=True)
  nb = _read(name)
  client = nbclient.NotebookClient(
      nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
      resources={"metadata": {"path": os.fspath(cwd)}})
  start = time.perf_counter()
  error = None
  try:
    await client.async_execute(env=env)
  except Exception as e:  # pylint: disable=broad-except
    error = e
  return Executed(nb, error, time.perf_counter() - start)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_saved_with_the_outputs_of_one_run(name):
  # Every code cell ran, once, in order, without an error; the run printed
  # and plotted; the file stays small.
  assert (COLAB / name).stat().st_size < MAX_SAVED_BYTES, name
  nb = _read(name)
  nbformat.validate(nb)
  counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
  assert counts == list(range(1, len(counts) + 1)), (name, counts)
  for i, cell in enumerate(nb.cells):
    for out in cell.get("outputs", ()):
      assert out.output_type != "error", f"{name} cell {i} saved an error."
  assert "".join(t for t in _outputs(nb, "text") if t), name
  assert any(d and "image/png" in d for d in _outputs(nb, "data")), name


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_notebooks_run(tmp_path):
  """Both notebooks, concurrently; reports every notebook that failed.

  One test rather than one per notebook, so that pytest-xdist cannot split
  them across workers (each would then have to start both).
  """
  pythonpath = os.pathsep.join(
      p for p in (os.fspath(ROOT), os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, SPECJAX_NOTEBOOK_PAIR="tiny", MPLBACKEND="Agg",
             PYTHONPATH=pythonpath)

  async def run_all():
    return await asyncio.gather(*(
        _execute(name, tmp_path / name.split(".")[0], env)
        for name in NOTEBOOKS))

  failures = []
  for name, result in zip(NOTEBOOKS, asyncio.run(run_all())):
    print(f"{name}: {result.seconds:.1f} s")
    if result.error is not None:
      message = re.sub(r"\x1b\[[0-9;]*m", "", str(result.error))  # colours
      failures.append(
          f"{name} failed after {result.seconds:.0f} s:\n{message}")
      continue
    if not "".join(t for t in _outputs(result.nb, "text") if t):
      failures.append(f"{name} printed nothing.")
    if not any(d and "image/png" in d for d in _outputs(result.nb, "data")):
      failures.append(f"{name} showed no plot.")
  if failures:
    pytest.fail("\n\n".join(failures), pytrace=False)
