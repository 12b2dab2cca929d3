"""Compiling for TPU with no TPU attached (`specjax.aot`).

Runs where libtpu is installed (`pip install -e ".[tpu]"`, CI's last
step: `pytest -m tpu_aot`); skipped elsewhere. First the HLO byte count is
checked on programs whose traffic is known, then the 1.5B pair is compiled
for a v5e chip from abstract weights.
"""

import os

import pytest

pytest.importorskip("libtpu")

from specjax.aot import chips  # pylint: disable=g-import-not-at-top

# Before JAX loads the TPU plugin (chips.devices sets the same).
for _k, _v in chips.environment(chips.CHIPS["v5e"]).items():
  os.environ.setdefault(_k, _v)

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top

from specjax import policies  # pylint: disable=g-import-not-at-top
from specjax import testing  # pylint: disable=g-import-not-at-top
from specjax.drafters import DraftModel  # pylint: disable=g-import-not-at-top
from specjax.drafters import PromptLookup  # pylint: disable=g-import-not-at-top
from specjax.aot import hlo  # pylint: disable=g-import-not-at-top
from specjax.aot import programs  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.tpu_aot
N, L = 4096, 8
MATRIX = N * N * 2  # one bf16 [N, N] matrix


@pytest.fixture(scope="module")
def mesh():
  return programs.make_mesh(chips.devices(chips.CHIPS["v5e"], 1))


def _compiled(mesh, fn, *shapes, donate=()):
  rep = NamedSharding(mesh, PartitionSpec())
  args = [jax.ShapeDtypeStruct(s, d, sharding=rep) for s, d in shapes]
  return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def _scan(ws, x):
  body = lambda x, i: (jnp.tanh(x @ ws[i]), None)
  return jax.lax.scan(body, x, jnp.arange(L))[0]


def _int8_scan(codes, scales, x):
  def body(x, i):  # dequantise one layer's slice, then multiply
    w = (codes[i].astype(jnp.float32) * scales[i]).astype(x.dtype)
    return jnp.tanh(x @ w), None
  return jax.lax.scan(body, x, jnp.arange(L))[0]


def _unrolled(ws, x):
  for i in range(L):
    x = jnp.tanh(x @ ws[i])
  return x


@pytest.mark.parametrize("name, fn, shapes, want", [
    ("matvec", lambda w, x: x @ w,
     [((N, N), jnp.bfloat16), ((1, N), jnp.bfloat16)], MATRIX),
    ("5 rows", lambda w, x: x @ w,
     [((N, N), jnp.bfloat16), ((5, N), jnp.bfloat16)], MATRIX),
    ("scan of 8", _scan,
     [((L, N, N), jnp.bfloat16), ((5, N), jnp.bfloat16)], L * MATRIX),
    ("unrolled 8", _unrolled,
     [((L, N, N), jnp.bfloat16), ((1, N), jnp.bfloat16)], L * MATRIX),
    # The stacked int8 codes are relaid out inside the fusion, on demand:
    # only the layer's slice is read.
    ("int8 scan of 8", _int8_scan,
     [((L, N, N), jnp.int8), ((L, 1, N), jnp.float32),
      ((5, N), jnp.bfloat16)], L * MATRIX // 2),
    ("int8 weights", lambda w, s, x: x @ (
        w.astype(jnp.float32) * s).astype(jnp.bfloat16),
     [((N, N), jnp.int8), ((1, N), jnp.float32), ((5, N), jnp.bfloat16)],
     MATRIX // 2),
])
def test_hlo_count_reads_each_matrix_once(mesh, name, fn, shapes, want):
  got = hlo.count(_compiled(mesh, fn, *shapes).as_text())
  assert want <= got.hbm_bytes <= 1.02 * want, (name, got.hbm_bytes, want)


def test_xla_bytes_accessed_counts_a_while_body_once(mesh):
  """Why the report counts the HLO itself: XLA's field misses L - 1 of
  the scan's layers."""
  shapes = [((L, N, N), jnp.bfloat16), ((5, N), jnp.bfloat16)]
  compiled = _compiled(mesh, _scan, *shapes)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert cost["bytes accessed"] < 1.1 * MATRIX
  assert hlo.count(compiled.as_text()).hbm_bytes >= L * MATRIX


@pytest.mark.slow
def test_qwen_pair_compiles_for_v5e_in_the_scan_layout(mesh):
  target = programs.abstract_model(
      testing.REAL_SHAPES["qwen2.5-coder-1.5b-instruct"], mesh)
  draft = programs.abstract_model(
      testing.REAL_SHAPES["qwen2.5-coder-0.5b-instruct"], mesh, split=False)
  assert target.plan.scan_layers
  call = programs.Call(target)
  lookup = PromptLookup(target.vocab_size)
  fn, args, static = call.speculative(DraftModel(draft),
                                      policies.Fixed(4))
  whole = programs.compile_program("model γ=4", fn, *args, static=static)
  assert whole.peak_bytes <= chips.CHIPS["v5e"].hbm_bytes
  # Scanned: the target's 28 layers and the draft's 24 are loops.
  assert whole.count.while_loops >= 4
  fn, args, static = call.speculative_step(lookup, policies.Fixed(8))
  step = programs.compile_program("lookup γ=8 step", fn, *args,
                                  static=static)
  size = call.speculative(lookup, policies.Fixed(8))[2]["cache_size"]
  budget = target.weight_bytes_per_token + programs.kv_bytes(
      target.config, jnp.bfloat16, call.batch, size)
  assert step.count.hbm_bytes <= 1.15 * budget, (step.count.hbm_bytes,
                                                 budget)
  assert step.count.hbm_bytes >= target.weight_bytes_per_token
  # The layers' slices feed the dots where they lie: a step writes its
  # cache entries and buffers, never a copy of a weight.
  assert step.count.hbm_written <= 0.05 * target.weight_bytes_per_token
