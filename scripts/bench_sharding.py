r"""Sharded verification: how to split the embedding and LM head.

Times the target's one-token forward and its (γ+1)-token verification pass
on a mesh, with the embedding and LM head split on the vocabulary
(`head="vocab"`) and on the hidden size (`head="hidden"`), random weights at
a real model's shapes, and prints the memory plan of each placement.

COMMAND (8 host devices on one CPU; the devices share its cores, so the
  figures show the communication pattern, not a multi-chip speed):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python scripts/bench_sharding.py --mesh=1x8 --batch=1 --gamma=4
COMMAND (a GPU node): python scripts/bench_sharding.py --mesh=1x8 \
  --dtype=bfloat16
"""

from __future__ import annotations

import pathlib
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments.validation import parse_mesh
from specjax import hardware
from specjax import models
from specjax import sharding
from specjax import testing
from specjax.sharding import memory

_TARGET = flags.DEFINE_string("target", "qwen2.5-coder-1.5b-instruct",
                              "A model of testing.REAL_SHAPES.")
_MESH = flags.DEFINE_string("mesh", "1x8", "DATAxMODEL.")
_BATCH = flags.DEFINE_integer("batch", 1, "B.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Verification of γ + 1 tokens.")
_CACHE = flags.DEFINE_integer("cache_size", 512, "S; half of it filled.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed passes (median).")


_STEP = jax.jit(lambda m, t, c: m(t, c)[0])  # logits [B, T, V]


def _pass(model, cache, width: int):
  """A function of no arguments running a `width`-token pass."""
  rows = cache.batch % model.mesh.shape[sharding.DATA] == 0
  tokens = sharding.global_array(
      np.ones((cache.batch, width), np.int32),
      jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec(
          sharding.DATA if rows else None)))
  return lambda: _STEP(model, tokens, cache)


def main(argv):
  del argv
  data, model_axis = parse_mesh(_MESH.value)
  mesh = sharding.make_mesh(data=data, model=model_axis)
  config = testing.REAL_SHAPES[_TARGET.value]
  dtype = jnp.dtype(_DTYPE.value)
  base = models.init_random(config, jax.random.key(0), dtype)
  print(f"{hardware.machine().get('cpu_model', '?')}, jax {jax.__version__},"
        f" {jax.device_count()} {jax.devices()[0].platform} devices, mesh "
        f"{_MESH.value}, {_TARGET.value} random weights {dtype.name}, "
        f"B={_BATCH.value}")
  steps, plans = {}, {}
  width = _GAMMA.value + 1
  for head in ("vocab", "hidden"):
    model = sharding.shard(base, mesh, head=head)
    cache = model.init_cache(_BATCH.value, _CACHE.value).rollback(
        jnp.full((_BATCH.value,), _CACHE.value // 2, jnp.int32))
    steps[f"{head}/1"] = _pass(model, cache, 1)
    steps[f"{head}/{width}"] = _pass(model, cache, width)
    plans[head] = memory.plan({"target": model}, batch=_BATCH.value,
                              cache_size=_CACHE.value, chunk=width,
                              limit=None)
  del base
  ms = hardware.median_ms(steps, _REPEATS.value)  # round-robin
  for head in ("vocab", "hidden"):
    one, verify = ms[f"{head}/1"], ms[f"{head}/{width}"]
    print(f"\nhead={head}: forward {one:.1f} ms, verify {width} tokens "
          f"{verify:.1f} ms ({verify / one:.2f}x)")
    print(plans[head].table())


if __name__ == "__main__":
  app.run(main)
