"""Two `jax.distributed` CPU processes on localhost decode what one does.

Both tests start two processes (`specjax.sharding.distributed`, gloo
collectives) and are marked slow; CI runs them in its slow step.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import distributed_worker  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.slow


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(argv_for, timeout=900):
  """Runs `argv_for(i)` as processes 0 and 1; returns their outputs."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  procs = [subprocess.Popen(argv_for(i), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT) for i in range(2)]
  outs = [p.communicate(timeout=timeout) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-4000:]
  return [out for out, _ in outs]


@pytest.mark.extended
def test_two_processes_decode_the_same_tokens_as_one():
  address = f"localhost:{_free_port()}"
  outs = _launch(lambda i: [sys.executable, str(ROOT / "tests" /
                                                "distributed_worker.py"),
                            address, str(i)])
  reference = distributed_worker.decode_all()  # this process, one device
  for out in outs:
    result = json.loads(out.strip().splitlines()[-1])  # after gloo's lines
    assert result["process_count"] == 2
    for mesh in ("2x1", "1x2"):
      assert result[mesh] == reference, mesh


@pytest.mark.extended
def test_experiment_runs_on_two_processes_and_writes_once(tmp_path):
  address = f"localhost:{_free_port()}"
  outs = _launch(lambda i: [
      sys.executable, "-m", "experiments.run",
      "--config=configs/tiny_pair.py:mesh=2x1,n=2,tokens=8",
      f"--config.output_dir={tmp_path / str(i)}", "--config.progress=false",
      "--config.plots=false", f"--coordinator_address={address}",
      "--num_processes=2", f"--process_id={i}"])
  assert (tmp_path / "0" / "results.json").is_file()
  assert not (tmp_path / "1").exists()
  assert "memory plan" in outs[0] and "2 device(s)" in outs[0]
  assert "specjax speculative decoding" not in outs[1]  # process 0 prints
  results = json.loads((tmp_path / "0" / "results.json").read_text())
  assert results["lossless"] is True
  assert results["memory"]["mesh"] == "2x1"
