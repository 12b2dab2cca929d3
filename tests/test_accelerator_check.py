"""scripts/accelerator_check.sh runs at tiny shapes on the CPU.

The check is written for a short GPU lease, where a failure costs the
lease: this runs every code path of it (both pairs, autoregressive at B = 1
and 8, model drafts at fixed γ and `auto`, prompt lookup, first-call and
operation counts) at tiny shapes first: run `pytest -m extended
tests/test_accelerator_check.py` before a lease.
"""

import json
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# One to five minutes on a 2-core CPU: the pre-flight of a GPU lease, run
# before one (`-m extended`), not in CI.
@pytest.mark.slow
@pytest.mark.extended
def test_accelerator_check_runs_at_tiny_shapes(tmp_path):
  out = tmp_path / "check"
  run = subprocess.run(
      ["bash", os.path.join(REPO, "scripts", "accelerator_check.sh"),
       str(out), "--tiny"], capture_output=True, text=True, timeout=600,
      check=False, env=dict(os.environ, PYTHONPATH=REPO))
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  record = json.loads((out / "accelerator_check.json").read_text())
  assert record["synthetic"] and record["machine"]["jax_version"]
  assert record["skipped"] == []
  results = {r["name"]: r for r in record["results"]}
  assert not [r for r in results.values() if "error" in r], results
  assert len(results) == 10  # 5 measurements for each of the two pairs
  for name, r in results.items():
    assert r["compile_s"] >= 0 and r["first_call_s"] > 0, name
    if "B=8" not in name:  # operations are counted at B = 1
      assert r["ops_per_step"] > 0, name
    if "autoregressive" in name:
      assert r["tokens_per_s"] > 0 and 0 < r["roofline_fraction"], name
      assert r["bytes_per_step"] > 0, name
    else:
      for one in r["runs"]:
        assert one["tokens_per_s"] > 0 and one["steps"] > 0, (name, one)
  fixed = results["llama-3-8b speculative gamma=4"]
  assert [one["alpha"] for one in fixed["runs"]] == [0.6, 0.8, 0.9]
  # Synthetic acceptance follows α: more tokens per step at a higher α.
  steps = [one["steps"] for one in fixed["runs"]]
  assert steps[0] >= steps[-1], steps
  assert (out / "environment.txt").exists()
