"""Runs the Colab notebooks on the tiny pair and saves them with outputs.

COMMAND: python scripts/save_notebooks.py [quickstart.ipynb] [anatomy.ipynb]

Each notebook runs top to bottom in a fresh `python3` kernel, as
tests/test_notebooks.py runs it (`SPECJAX_NOTEBOOK_PAIR=tiny`, the Agg
matplotlib backend, this checkout first on `PYTHONPATH`, a temporary working
directory), on the CPU (`JAX_PLATFORMS=cpu`: no accelerator probing in the
saved output), and is written back in place with its outputs, so that a
reader sees the tables and plots before running anything. Stream outputs
are merged and progress-bar redraws dropped. Run it after a change that
changes what the notebooks print; the test checks that each saved notebook
holds a complete run.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = ("quickstart.ipynb", "anatomy.ipynb")
CELL_TIMEOUT_S = 600


def main(names: list[str]) -> None:
  pythonpath = os.pathsep.join(
      p for p in (os.fspath(ROOT), os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, SPECJAX_NOTEBOOK_PAIR="tiny", MPLBACKEND="Agg",
             PYTHONPATH=pythonpath, JAX_PLATFORMS="cpu")
  for name in names or NOTEBOOKS:
    path = COLAB / name
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as cwd:
      client = nbclient.NotebookClient(
          nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
          record_timing=False, coalesce_streams=True,
          resources={"metadata": {"path": cwd}})
      start = time.perf_counter()
      client.execute(env=env)
    nbformat.write(nb, path)
    print(f"{name}: {time.perf_counter() - start:.0f} s, "
          f"{path.stat().st_size / 1024:.0f} KiB saved")


if __name__ == "__main__":
  main(sys.argv[1:])
