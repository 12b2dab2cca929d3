r"""Microbenchmark of the weight-layout decision on XLA (CPU, fp32 by default).

Decoding reads every weight once per forward, so a forward of 1 token (a
decode step) and of γ+1 tokens (a verification pass) should cost about the
same: the weights' read time. Whether they do depends on how XLA's dot
handles the stored layout. This times a stack of Qwen2.5-1.5B-shaped layers
(E=1536, F=8960, 12 query and 2 key/value heads of 128: q, k, v, o, gate, up,
down) as `x @ W` with W stored [in, out], and with W stored [out, in]
contracted on its last axis, for 1 and 5 rows, plus the memory bandwidth of
a large array read in the same process, and prints a table.

COMMAND: python scripts/bench_layout.py --layers=8 --rows=1,5

Earlier measurement on the 2-core reference machine, 8 layers: [in, out]
~50 ms (1 row) / ~56 ms (5 rows); [out, in] ~40 / ~91 ms.
"""

from __future__ import annotations

import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

_LAYERS = flags.DEFINE_integer("layers", 8, "Layers in the stack.")
_ROWS = flags.DEFINE_list("rows", ["1", "5"], "Rows (tokens) per forward.")
_HIDDEN = flags.DEFINE_integer("hidden", 1536, "E, the hidden size.")
_MLP = flags.DEFINE_integer("mlp", 8960, "F, the MLP hidden size.")
_KV = flags.DEFINE_integer("kv", 256, "Key/value width (K * D).")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls (median).")
_READ_GIB = flags.DEFINE_float("read_gib", 1.0,
                               "Size of the array read for bandwidth.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Weight and activation dtype.")

LAYOUTS = ("[in, out]", "[out, in]")


def layer_shapes(e: int, f: int, kv: int) -> dict[str, tuple[int, int]]:
  """(in, out) of each projection of one layer."""
  return {"q": (e, e), "k": (e, kv), "v": (e, kv), "o": (e, e),
          "gate": (e, f), "up": (e, f), "down": (f, e)}


def make_weights(layout: str, layers: int, shapes, dtype, key):
  """[L] list of {name: W}, W [in, out] or [out, in]."""
  out = []
  for _ in range(layers):
    layer = {}
    for name, (n_in, n_out) in shapes.items():
      key, sub = jax.random.split(key)
      shape = (n_in, n_out) if layout == LAYOUTS[0] else (n_out, n_in)
      layer[name] = (jax.random.normal(sub, shape, jnp.float32)
                     * n_in ** -0.5).astype(dtype)
    out.append(layer)
  return out


def _mm(x, w, transposed: bool):
  """x [T, in] @ W -> [T, out]; W is [out, in] when `transposed`."""
  dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
  return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32
                             ).astype(x.dtype)


def stack_fn(transposed: bool):
  """A jitted forward through every layer's projections (no attention)."""

  @jax.jit
  def forward(x, weights):  # x [T, E]
    for layer in weights:
      q = _mm(x, layer["q"], transposed)
      k = _mm(x, layer["k"], transposed)
      v = _mm(x, layer["v"], transposed)
      # Keep k and v live without an attention: fold them into q's width.
      kv = jnp.tile(k + v, (1, q.shape[1] // k.shape[1] + 1))[:, :q.shape[1]]
      x = x + _mm(q + kv, layer["o"], transposed)
      h = (jax.nn.silu(_mm(x, layer["gate"], transposed))
           * _mm(x, layer["up"], transposed))  # [T, F]
      x = x + _mm(h, layer["down"], transposed)
    return x

  return forward


def median_ms(fn, *args, repeats: int) -> float:
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def read_bandwidth(gib: float, repeats: int) -> tuple[float, float]:
  """(ms, GB/s) of summing a `gib` GiB float32 array."""
  n = int(gib * (1 << 30)) // 4
  big = jnp.ones((n,), jnp.float32)
  ms = median_ms(jax.jit(jnp.sum), big, repeats=repeats)
  return ms, n * 4 / ms / 1e6


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  shapes = layer_shapes(_HIDDEN.value, _MLP.value, _KV.value)
  params = sum(a * b for a, b in shapes.values()) * _LAYERS.value
  weight_bytes = params * dtype.itemsize
  rows = [int(r) for r in _ROWS.value]
  print(f"device: {jax.devices()[0]} ({jax.default_backend()}), dtype "
        f"{dtype.name}, {_LAYERS.value} layers of E={_HIDDEN.value} "
        f"F={_MLP.value} kv={_KV.value}: {weight_bytes / 1e9:.2f} GB of "
        f"weights, median of {_REPEATS.value}")
  results = []
  key = jax.random.key(0)
  for layout in LAYOUTS:
    weights = make_weights(layout, _LAYERS.value, shapes, dtype, key)
    forward = stack_fn(transposed=layout == LAYOUTS[1])
    for t in rows:
      x = jnp.asarray(np.random.default_rng(0).normal(
          size=(t, _HIDDEN.value)), dtype)
      ms = median_ms(forward, x, weights, repeats=_REPEATS.value)
      results.append((layout, t, ms, weight_bytes / ms / 1e6))
    del weights
  read_ms, read_gbs = read_bandwidth(_READ_GIB.value, _REPEATS.value)

  header = ("layout", "rows", "ms / forward", "weights GB/s", "vs 1 row")
  table = []
  for layout, t, ms, gbs in results:
    one = next(m for l, r, m, _ in results if l == layout and r == rows[0])
    table.append((layout, str(t), f"{ms:.1f}", f"{gbs:.1f}",
                  f"{ms / one:.2f}x"))
  widths = [max(len(c) for c in col) for col in zip(header, *table)]
  fmt = lambda cells: "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
  print(fmt(header))
  print(fmt(["-" * w for w in widths]))
  for row in table:
    print(fmt(row))
  print(f"memory read: {_READ_GIB.value:g} GiB float32 sum in {read_ms:.1f} "
        f"ms = {read_gbs:.1f} GB/s (the floor for one forward is weights / "
        f"bandwidth = {weight_bytes / read_gbs / 1e6:.1f} ms)")


if __name__ == "__main__":
  app.run(main)
