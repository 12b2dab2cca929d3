"""Sharded decoding: equal to one device, really split, memory planned.

The multi-device checks run `tests/sharding_worker.py` in subprocesses with
8 host CPU devices, on meshes 1x8, 2x4 and 8x1 (slow: about 80 s of
compiles on a 2-core EPYC), in two parts (`PARTS`) that two pytest-xdist
workers can run at once, each once per pytest run (the `worker` fixture).
The rest run here on this process's one device.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from specjax import buffers
from specjax import compilation
from specjax import decode
from specjax import loops
from specjax import sampling
from specjax import sharding
from specjax import testing
from specjax.checkpoints import native
from specjax.models import MatmulPlan
from specjax.models.config import flatten
from specjax.models.config import param_shapes
from specjax.sharding import memory
from specjax.sharding import rules
from specjax.sharding.batch import Placement

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESHES = ("1x8", "2x4", "8x1")
PARTS = ("1x8,8x1", "2x4")  # one subprocess each; 2x4 adds the memory plan


@pytest.fixture(scope="session")
def worker(tmp_path_factory, worker_id):
  """mesh -> the JSON of the subprocess that ran it (its part of `PARTS`).

  Each part runs once per pytest run. pytest-xdist workers share its JSON
  through a file under the run's temporary root, under a lock per part: the
  first worker to ask runs the subprocess, a second one asking for the same
  part waits and reads (`--dist loadgroup` cannot keep the module on one
  worker: pytest 9.2 ignores the group suffix xdist writes,
  pytest-xdist#1386).
  """
  root = tmp_path_factory.getbasetemp()
  if worker_id != "master":
    root = root.parent  # shared by the workers of this run only

  def run(mesh: str) -> dict:
    part = next(p for p in PARTS if mesh in p.split(","))
    out = root / f"sharding_worker_{part}.json"
    with open(root / f"sharding_worker_{part}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if not out.exists():
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "sharding_worker.py"),
             part], capture_output=True, text=True, env=env, timeout=1200,
            check=False)
        assert done.returncode == 0, done.stderr[-4000:]
        out.write_text(done.stdout)
    return json.loads(out.read_text())

  return run


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_greedy_equals_unsharded(worker, mesh):
  out = worker(mesh)
  reference = out["reference"]
  # Ragged rows, B = 3 on data axes of 1, 2 and 8.
  assert {len(row) for row in reference[0]} == {12}
  run = out["meshes"][mesh]
  assert run["decoded"] == reference  # generate, speculative, lengths
  assert run["decoded_by_argument"] == reference  # mesh= placing the models
  # The placement variants run on the mesh with both axes (2x4).
  assert ("draft_split" in run) == ("head_hidden" in run) == (mesh == "2x4")
  if mesh == "2x4":
    assert run["draft_split"] == reference[1]  # the draft split as well
    assert run["scanned"] == reference  # stacked layers, scanned
    assert run["head_hidden"] == reference  # embedding/head split on E


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ("1x8", "2x4"))
def test_parameters_and_cache_are_split_on_the_model_axis(worker, mesh):
  layout = worker(mesh)["meshes"][mesh]["layout"]
  model = layout["model_axis"]
  assert model == int(mesh.split("x")[1])
  for path, (total, per_device) in layout["params"].items():
    assert per_device * model == total, path
  total, per_device = layout["cache"]
  assert per_device * model * (8 // model) == total  # heads x rows
  assert layout["replicated_params"] == []
  # Only [B, T, E] activations may be whole on every device (the hidden
  # size is not split: Megatron layout); never logits or the cache.
  assert all(shape[-1] == testing.SHARDABLE_TARGET.hidden_size
             for shape in layout["replicated_outputs"])
  assert layout["draft_replicated"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ("1x8", "2x4"))
def test_vocab_split_logits_are_not_gathered_per_position(worker, mesh):
  """With the LM head split on the vocabulary, no [..., V] array is
  gathered, top-k / top-p branch included: its thresholds are bisected
  with per-row counts and sums (`sampling._filtered_logits`), and a token
  is drawn by per-block sums (`sampling.sample`)."""
  gathers = worker(mesh)["meshes"][mesh]["vocab_gathers"]
  assert gathers["all_gathers"]  # the check sees the program's gathers
  assert gathers["vocab"] == []


@pytest.mark.slow
def test_memory_plan_matches_live_arrays(worker):
  plan = worker("2x4")["memory"]
  assert plan["live_on_device_0"] > 0
  assert abs(plan["planned_weights"] / plan["live_on_device_0"] - 1) < 0.05
  message = plan["impossible"]
  assert message is not None
  for piece in ("batch 4096", "cache size 65536", "64.00 MiB",
                "target cache", "8 device(s)"):
    assert piece in message


def test_rules_cover_every_parameter_of_every_architecture():
  mesh = sharding.make_mesh(data=1, model=1)
  for config in (testing.TINY_TARGET, testing.SHARDABLE_TARGET,
                 testing.SHARDABLE_DRAFT):
    specs = flatten(rules.param_specs(config, mesh))
    assert set(specs) == set(flatten(param_shapes(config)))


def test_partition_specs_follow_the_layout():
  mesh = sharding.make_mesh(data=1, model=1)
  config = testing.SHARDABLE_TARGET
  get = lambda plan: flatten(rules.param_specs(
      config, mesh, plan=MatmulPlan.parse(plan)))
  in_out, out_in = get("in_out/xla"), get("out_in/xla")
  model = sharding.MODEL
  assert tuple(in_out["layers_0/q"]) == (None, model)
  assert tuple(out_in["layers_0/q"]) == (model, None)
  assert tuple(in_out["layers_0/down"]) == (model, None)
  assert tuple(in_out["lm_head"]) == (None, model)
  assert tuple(in_out["embed"]) == (model, None)
  assert tuple(in_out["layers_0/q_bias"]) == (model,)
  assert tuple(in_out["final_norm"]) == (None,)
  hidden = flatten(rules.param_specs(config, mesh, head="hidden"))
  assert tuple(hidden["embed"]) == (None, model)
  replicated = flatten(rules.param_specs(config, mesh, split=False))
  assert all(all(a is None for a in s) for s in replicated.values())


def test_unknown_parameter_and_bad_mesh_errors():
  with pytest.raises(ValueError, match="No partition rule.*'mystery'"):
    rules.logical_axes("mystery")
  with pytest.raises(ValueError, match="needs 6 devices; 1 given"):
    sharding.make_mesh(data=2, model=3)
  with pytest.raises(ValueError, match="head must be one of"):
    rules.mesh_axes(head="rows")


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_padding_rows_start_done_and_are_cut():
  """On one device the padding path is the same code: pad 3 rows to 4 by
  hand and check the added row generates nothing and is dropped."""
  mesh = sharding.make_mesh(data=1, model=1)
  assert Placement(mesh=mesh, batch=3).padded == 3
  tokens = np.ones((3, 16), np.int32)
  lengths = np.array([2, 3, 4], np.int32)
  padded = _Padded(batch=3)
  t, l, budget = padded.inputs(tokens, lengths, 5)
  assert t.shape == (4, 16) and list(np.asarray(l)) == [2, 3, 4, 1]
  assert list(np.asarray(budget)) == [5, 5, 5, 0]
  target, _ = testing.tiny_pair()
  out, counts = loops.generate_loop(  # pylint: disable=protected-access
      target, t, l, sampling.SamplingParams.create(),
      buffers.eos_array(None), jax.random.key(0), budget,
      tokens_cap=64, cache_size=128, pad_id=0)
  assert list(np.asarray(counts)) == [5, 5, 5, 0]
  rows = padded.rows(out)
  assert rows.shape[0] == 3
  full = decode.generate(target, [[1, 1], [1, 1, 1], [1] * 4],
                         max_new_tokens=5)
  np.testing.assert_array_equal(rows[:, :5], full.tokens)


class _Padded(Placement):
  """A placement that pads to a multiple of 4 on one device."""

  def __init__(self, batch):
    super().__init__(mesh=None, batch=batch)

  @property
  def padded(self):
    return -(-self.batch // 4) * 4


def test_loaders_place_each_tensor_on_the_mesh(tmp_path):
  target, _ = testing.tiny_pair()
  native.save(target, tmp_path / "model.safetensors")
  mesh = sharding.make_mesh(data=1, model=1)
  loaded = native.load(tmp_path / "model.safetensors", mesh=mesh)
  assert loaded.mesh == mesh
  for path, x in flatten(loaded.params).items():
    assert isinstance(x.sharding, jax.sharding.NamedSharding), path
    assert x.sharding.mesh == mesh
    np.testing.assert_array_equal(x, flatten(target.params)[path])
  # Its caches are laid out on the mesh too.
  cache = loaded.init_cache(2, 16)
  assert cache.k.sharding.mesh == mesh
  # A model on a mesh and one that is not cannot decode together.
  with pytest.raises(ValueError, match="different meshes"):
    sharding.mesh_of(loaded, target)


def test_memory_plan_counts_bytes_and_fails_before_compiling():
  target, draft = testing.tiny_pair()
  plan = memory.plan({"target": target, "draft": draft}, batch=2,
                     cache_size=128, chunk=4, limit=None)
  weights = sum(x.nbytes for x in jax.tree.leaves(target.params))
  assert plan.bytes("target", "weights") == weights
  c = target.config
  assert plan.bytes("target", "cache") == (
      2 * c.num_layers * 2 * 128 * c.num_kv_heads * c.head_dim * 4 + 2 * 4)
  assert plan.bytes("target", "logits") == 2 * 4 * c.vocab_size * 4
  before = compilation.num_compiled()
  with pytest.raises(MemoryError, match=r"cache size 1073741824"):
    decode.speculative_generate(target, draft, [[1, 2, 3]], gamma=2,
                                max_new_tokens=4, cache_size=1 << 30)
  assert compilation.num_compiled() == before
