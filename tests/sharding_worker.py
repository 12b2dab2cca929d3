"""Runs sharded decoding on 8 host CPU devices and prints what it saw (JSON).

Usage: `python tests/sharding_worker.py 1x8,8x1` (the meshes, data x
model; the memory plan runs with 2x4). Started by tests/test_sharding.py
in a subprocess, because the device count
(`--xla_force_host_platform_device_count=8`) must be set before JAX starts
and must not leak into the other tests. Every comparison is made here
against a one-device run of the same models; the test asserts on the JSON.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from specjax import decode
from specjax import loops
from specjax import models
from specjax import policies
from specjax import drafters
from specjax import speculate
from specjax import sharding
from specjax import testing
from specjax.sharding import batch as batch_lib
from specjax.sharding import memory
from specjax.sharding import rules
from specjax.models.config import flatten

# Ragged rows; 3 is no multiple of a data axis of 2 or 8.
PROMPTS = [[5, 17, 3, 9, 200, 41, 7], [11, 2], [99, 98, 97, 96]]
N = 12


def _decode(target, draft, mesh=None, **kwargs):
  ar = decode.generate(target, PROMPTS, max_new_tokens=N, mesh=mesh,
                       **kwargs)
  spec = decode.speculative_generate(target, draft, PROMPTS, gamma=3,
                                     max_new_tokens=N, mesh=mesh, **kwargs)
  return ar.tokens.tolist(), spec.tokens.tolist(), spec.lengths.tolist()


def _layout(target, draft, mesh):
  """Per-device bytes of the big parameters and of the cache, and the
  output shardings of a compiled verification pass."""
  model = mesh.shape["model"]
  params = {p: (x.nbytes, rules.per_device_bytes(x))
            for p, x in flatten(target.params).items()
            if x.ndim == 2}
  cache = jax.jit(lambda: target.init_cache(8, 64))()
  tokens = sharding.global_array(
      np.zeros((8, 4), np.int32),
      sharding.place.batch_sharding(mesh, 2))
  step = jax.jit(lambda m, t, c: m(t, c)).lower(target, tokens, cache)
  outs = step.compile().output_shardings
  flat_out = jax.tree.leaves(outs)
  shapes = jax.tree.leaves(jax.eval_shape(lambda m, t, c: m(t, c), target,
                                          tokens, cache))
  replicated = [list(s.shape) for s, o in zip(shapes, flat_out)
                if np.prod(s.shape) * s.dtype.itemsize >= 4096
                and o.is_fully_replicated]
  return {
      "model_axis": model,
      "params": params,
      "cache": [cache.k.nbytes, rules.per_device_bytes(cache.k)],
      "replicated_outputs": replicated,
      "replicated_params": rules.replicated_large(target.params, 1024),
      "draft_replicated": all(
          x.sharding.is_fully_replicated
          for x in jax.tree.leaves(draft.params)),
  }


def _vocab_gathers(target, draft, mesh):
  """[shape, op name] of every all-gather of a vocabulary-sized array in
  the compiled sampling program (temperature 1: every branch compiled)."""
  where, (target, draft) = batch_lib.Placement.resolve(mesh, 3, target,
                                                       draft)
  tokens, lengths, budget = where.inputs(np.ones((3, 16), np.int32),
                                         np.array([3, 2, 4], np.int32), 8)
  lowered = loops.speculative_loop.lower(  # pylint: disable=protected-access
      target, drafters.DraftModel(draft), tokens, lengths,
      speculate.StepParams.create(temperature=1.0), jax.random.key(0),
      budget, policies.Fixed(3), tokens_cap=64, cache_size=128, pad_id=0,
      num_nodes=None)
  vocab = target.vocab_size
  gathers, seen = [], 0
  for line in lowered.compile().as_text().splitlines():
    match = re.search(r"= \w+\[([\d,]+)\]\S* all-gather\(", line)
    seen += bool(match)
    if match and int(match.group(1).split(",")[-1]) == vocab:
      name = re.search(r'op_name="([^"]+)"', line)
      gathers.append([[int(d) for d in match.group(1).split(",")],
                      name.group(1) if name else ""])
  return {"vocab": gathers, "all_gathers": seen}


def _memory(target, draft, mesh):
  """The plan's weight bytes against the live arrays on one device."""
  device = mesh.devices.flat[0]
  live = sum(s.data.nbytes for x in jax.live_arrays()
             for s in x.addressable_shards if s.device == device)
  planned = memory.plan({"target": target, "draft": draft}, batch=3,
                        cache_size=64, mesh=mesh, limit=None)
  weights = planned.bytes("target", "weights") + planned.bytes(
      "draft", "weights")
  try:
    memory.plan({"target": target, "draft": draft}, batch=4096,
                cache_size=1 << 16, mesh=mesh, limit=64 << 20).check()
    error = None
  except MemoryError as e:
    error = str(e)
  return {"planned_weights": weights, "live_on_device_0": live,
          "impossible": error}


def main(meshes: str) -> None:
  assert jax.device_count() == 8, jax.devices()
  target, draft = testing.tiny_pair(shardable=True)
  reference = _decode(target, draft)
  out = {"reference": reference, "meshes": {}}
  shapes = [tuple(map(int, m.split("x"))) for m in meshes.split(",")]
  for data, model in shapes:
    mesh = sharding.make_mesh(data=data, model=model)
    placed = sharding.shard(target, mesh)
    small = sharding.shard(draft, mesh, split=False)
    entry = {"decoded": _decode(placed, small),
             "decoded_by_argument": _decode(target, draft, mesh=mesh)}
    if model > 1:
      entry["layout"] = _layout(placed, small, mesh)
      entry["vocab_gathers"] = _vocab_gathers(placed, small, mesh)
    if data > 1 and model > 1:  # the placement variants, on both axes
      entry["draft_split"] = _decode(placed, sharding.shard(draft, mesh))[1]
      # The accelerator layout: layers stacked [L, ...] and scanned.
      scan = models.MatmulPlan(scan_layers=True)
      entry["scanned"] = _decode(
          sharding.shard(target.with_plan(scan), mesh),
          sharding.shard(draft.with_plan(scan), mesh, split=False))
      entry["head_hidden"] = _decode(
          sharding.shard(target, mesh, head="hidden"), small)
    del placed, small
    out["meshes"][f"{data}x{model}"] = entry
  if (2, 4) in shapes:  # the memory plan, with only sharded copies live
    mesh = sharding.make_mesh(data=2, model=4)
    jax.clear_caches()
    target_m = sharding.shard(target, mesh)
    draft_m = sharding.shard(draft, mesh, split=False)
    del target, draft
    out["memory"] = _memory(target_m, draft_m, mesh)
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main(sys.argv[1])
