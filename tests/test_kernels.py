"""The small-M CPU kernel and `MatmulPlan`s.

Shape letters: M rows, K input features, N output features.

The reference is numpy in float64. The sizes cover every code path of the
kernel: row groups (M up to 12 in one tile, more split into groups), weight
tiles of 1, 2 or 4 rows and their remainders (N not a multiple of the
tile), and K not a multiple of the vector width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu
from specjax import decode
from specjax import testing
from specjax.cpu import kernels
from specjax.models import MatmulPlan
from specjax.models.matmul import project

needs_kernels = pytest.mark.skipif(not kernels.available(),
                                   reason="no C++ compiler or not CPU")


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 7, 9, 12, 13, 25, 64])
@pytest.mark.parametrize("k,n", [(16, 4), (37, 7), (96, 130), (300, 9)])
def test_smallm_matches_float64(m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((n, k)).astype(np.float32)
  got = np.asarray(jax.jit(kernels.smallm_matmul)(x, w))
  want = x.astype(np.float64) @ w.astype(np.float64).T
  assert got.shape == (m, n)
  # float32 accumulation of k products of unit normals.
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * k)


@needs_kernels
def test_smallm_rejects_bad_input():
  x = jnp.ones((2, 8), jnp.float32)
  with pytest.raises(ValueError, match="float32"):
    kernels.smallm_matmul(x.astype(jnp.bfloat16), jnp.ones((4, 8)))
  with pytest.raises(ValueError, match=r"x \[X, I\] and w \[O, I\]"):
    kernels.smallm_matmul(x, jnp.ones((4, 7), jnp.float32))
  with pytest.raises(ValueError, match="at most"):
    kernels.smallm_matmul(jnp.ones((kernels.MAX_ROWS + 1, 8)),
                          jnp.ones((4, 8)))


@needs_kernels
@pytest.mark.parametrize("in_out", [False, True])
@pytest.mark.parametrize("m", [1, 9, 70])
def test_pick_reads_a_slab_of_a_stack_as_its_own_matrix(m, in_out):
  """One stack [L, O, I] (or [L, I, O] in_out: a layer's experts): slab
  `index` times x, bit for bit the product of that slab passed as its own
  matrix, each row as it is alone, and float64's to float32 rounding.
  O = 70 leaves in_out columns past its whole vectors and tiles."""
  rng = np.random.default_rng(m)
  shape = (3, 96, 70) if in_out else (3, 70, 96)
  stack = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((m, 96)).astype(np.float32))
  pick = jax.jit(kernels.smallm_pick, static_argnums=3)
  for i in range(3):
    np.testing.assert_array_equal(
        np.asarray(pick(x, jnp.int32(i), stack, in_out)),
        np.asarray(pick(x, jnp.int32(0), (stack[i],), in_out)))
  got = np.asarray(pick(x, jnp.int32(2), stack, in_out))
  w = np.asarray(stack[2], np.float64)
  want = np.asarray(x, np.float64) @ (w if in_out else w.T)
  np.testing.assert_allclose(got, want, atol=1e-5 * 96)
  np.testing.assert_array_equal(
      np.asarray(pick(x[-1:], jnp.int32(2), stack, in_out)), got[-1:])
  want = r"\[96, O\] float32" if in_out else r"\[O, 96\] float32"
  with pytest.raises(ValueError, match=want):
    kernels.smallm_pick(x, jnp.int32(0), jnp.ones((3, 95, 95), jnp.float32),
                        in_out)


def test_plan_names_and_errors():
  for name in ("in_out/xla", "out_in/xla", "out_in/kernel", "out_in/hybrid"):
    assert cpu.plan(name).name == name
  assert cpu.plan("out_in/hybrid").kernel_min_rows == 2
  with pytest.raises(ValueError, match="kernel_min_rows"):
    MatmulPlan(layout="out_in", kernel=cpu.SMALLM, kernel_min_rows=40)
  with pytest.raises(ValueError, match="Unknown matmul plan"):
    MatmulPlan.parse("out_in/cuda")
  with pytest.raises(ValueError, match="Unknown matmul layout"):
    MatmulPlan.parse("columns/xla")
  with pytest.raises(ValueError, match="use layout='out_in'"):
    MatmulPlan(layout="in_out", kernel=cpu.SMALLM)


@pytest.mark.parametrize("name", [
    "in_out/xla", "out_in/xla",
    pytest.param("out_in/kernel", marks=needs_kernels),
    pytest.param("out_in/hybrid", marks=needs_kernels)])
def test_project_equals_product_for_every_plan(name):
  plan = cpu.plan(name)
  rng = np.random.default_rng(0)
  w = rng.standard_normal((24, 40)).astype(np.float32)  # [I, O]
  stored = w.T.copy() if plan.transposed else w
  for rows in (1, 3, 40):  # 40 rows exceed kernel_max_rows: XLA fallback
    x = rng.standard_normal((2, rows, 24)).astype(np.float32)
    got = jax.jit(project, static_argnums=2)(x, stored, plan)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, atol=1e-4)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_with_plan_round_trips_and_keeps_greedy_output():
  target, draft = testing.tiny_pair(seed=3)
  prompts = [[5, 6, 7], [8, 9]]
  ref = decode.generate(target, prompts, max_new_tokens=8)
  names = ["out_in/xla"] + (["out_in/kernel", "out_in/hybrid"]
                            if kernels.available() else [])
  for name in names:
    t, d = target.with_plan(cpu.plan(name)), draft.with_plan(cpu.plan(name))
    assert t.params["layers_0"]["gate"].shape == (128, 64)  # [F, E]
    out = decode.speculative_generate(t, d, prompts, gamma=3,
                                      max_new_tokens=8)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    back = t.with_plan("in_out/xla")
    for a, b in zip(jax.tree.leaves(back.params),
                    jax.tree.leaves(target.params)):
      np.testing.assert_array_equal(a, b)
