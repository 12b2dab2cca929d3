"""The small-M CPU kernel and `MatmulPlan`s.

Shape letters: M rows, K input features, N output features.

The reference is numpy in float64. The sizes cover every code path of the
kernel: row groups (M up to 12 in one tile, more split into groups), weight
tiles of 1, 2 or 4 rows and their remainders (N not a multiple of the
tile), and K not a multiple of the vector width.
"""

from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu
from specjax import decode
from specjax import testing
from specjax.checkpoints import gguf_blocks
from specjax.cpu import kernels
from specjax.models import MatmulPlan
from specjax.models import quantized
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


@functools.cache
def _experts(name: str) -> tuple[quantized.QuantizedMatrix, ...]:
  """Three different experts [O, I] = [42, 512] of format `name` ("int8",
  "int4" with mins, or a GGUF block type), each its own matrix."""
  rng = np.random.default_rng(0)
  if name.startswith("int"):
    spec = quantized.QuantSpec.parse(name)
    qms = [quantized.quantize_array(w, spec, name)
           for w in rng.normal(0, 1, (3, 42, 512)).astype(np.float32)]
  else:
    qtype = gguf.GGMLQuantizationType[name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    qms = [gguf_blocks.from_blocks(
        testing.random_blocks(qtype, 42, 512 // block, seed=e), qtype, "t",
        (512, 42)) for e in range(3)]
  return tuple(jax.tree.map(jnp.asarray, w) for w in qms)


@needs_kernels
@pytest.mark.parametrize("act_bits", [0, 8])
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("name", ["int8", "int4", "Q8_0", "Q4_K"])
def test_quantized_pick_reads_an_expert_of_a_stack_as_its_own_matrix(
    name, rows, act_bits):
  """One packed stack [L, O, I] (a layer's experts; q4_k with integer
  sub-scales and float16 super-block factors): expert `index` (traced)
  times x, bit for bit `smallm_quantized` on that expert alone, in pieces
  of 64 rows as the pick's passes (70 rows take two)."""
  experts = tuple(w.replace(act_bits=act_bits) for w in _experts(name))
  assert all(cpu.SMALLM.supports(w) for w in experts)
  assert (experts[0].mins is not None) == (name in ("int4", "Q4_K"))
  stack = jax.tree.map(lambda *a: jnp.stack(a), *experts)  # [3, O, ...]
  x = jax.random.normal(jax.random.key(rows), (rows, 512), jnp.float32)
  pick = jax.jit(cpu.SMALLM.pick)
  alone = jax.jit(cpu.SMALLM.quantized_matmul)
  assert "specjax_smallm_quant_pick" in pick.lower(
      x, jnp.int32(0), stack).as_text()
  got = [np.asarray(pick(x, jnp.int32(i), stack)) for i in range(3)]
  for i, w in enumerate(experts):
    np.testing.assert_array_equal(got[i], np.asarray(alone(x, w)))
  assert not np.array_equal(got[0], got[1])  # the experts differ


@needs_kernels
def test_quantized_pick_refuses_a_bad_stack():
  w = jax.tree.map(lambda *a: jnp.stack(a), *_experts("Q4_K"))
  stack = dict(codes=w.low, scales=w.scales, mins=w.mins, high=w.high,
               super_scales=w.super_scales, super_mins=w.super_mins,
               bits=w.bits, group=w.group, offset=w.offset)
  x = jnp.ones((3, 512), jnp.float32)
  pick = kernels.smallm_quantized_pick
  with pytest.raises(ValueError, match="scalar index"):
    pick(x, jnp.zeros((1,), jnp.int32), stack)
  with pytest.raises(ValueError, match="with one L"):
    pick(x, jnp.int32(0), dict(stack, scales=stack["scales"][:2]))
  with pytest.raises(ValueError, match="with one L"):
    pick(x, jnp.int32(0), dict(stack, codes=stack["codes"][0]))
  # An expert's arrays must make the format, as a single matrix's must.
  with pytest.raises(ValueError, match="4-bit matrix of groups of 32"):
    pick(x, jnp.int32(0), dict(stack, super_mins=None))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match="index 3 is not below L = 3"):
    jax.block_until_ready(
        jax.jit(lambda x, i: pick(x, i, stack))(x, jnp.int32(3)))


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
