"""The CPU kernel on packed weights (`kernels.smallm_quantized`).

Shape letters: X rows, O outputs, I inputs. The kernel must compute the
same product as the XLA path (`quantized.matmul` without `kernel`) from
the same packed arrays, to float32 accumulation-order rounding.
"""

import os
import pathlib
import platform
import shutil
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu
from specjax import decode
from specjax.checkpoints import gguf_blocks
from specjax.cpu import kernels
from specjax.models import matmul
from specjax.models import quantized
from specjax.models import tiny
from specjax.testing import random_blocks
from test_quantized import _assert_rounding_close

Q = gguf.GGMLQuantizationType
KERNEL = cpu.SMALLM
pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="no C++ compiler for the kernels")


def _matrices():
  # 42 outputs: the int8 kernel's tiles of four weight rows leave two.
  w = np.random.default_rng(0).normal(0, 1, (42, 512)).astype(np.float32)
  out = {s: quantized.quantize_array(w, quantized.QuantSpec.parse(s), s)
         for s in ("int8", "int4", "int4:g16:sym", "int4:g64:sym")}
  for qtype in (Q.Q8_0, Q.Q4_K, Q.Q5_0, Q.Q6_K):
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    out[qtype.name] = gguf_blocks.from_blocks(
        random_blocks(qtype, 42, 512 // block), qtype, "t", (512, 42))
  return {k: jax.tree.map(jnp.asarray, v) for k, v in out.items()}


MATRICES = _matrices()


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("rows", [1, 5, 9, 13, 33])
def test_kernel_equals_the_xla_product(name, rows):
  w = MATRICES[name]
  assert KERNEL.supports(w)
  x = jax.random.normal(jax.random.key(rows), (rows, 512), jnp.float32)
  got = jax.jit(lambda x, w: quantized.matmul(x, w, kernel=KERNEL))(x, w)
  want = jax.jit(quantized.matmul)(x, w)
  assert "specjax_smallm_quant" in jax.jit(
      lambda x, w: quantized.matmul(x, w, kernel=KERNEL)).lower(
          x, w).as_text()
  _assert_rounding_close(np.asarray(got), np.asarray(want))
  # Each output row's sum runs in the same order whatever X is and
  # whichever tile of rows holds it (9 rows: two tiles, each dequantising
  # in registers; 13 and 33: dequantised once, then loaded), so a
  # verification pass reproduces the decode step's values exactly.
  one_row = jax.jit(lambda x, w: quantized.matmul(x, w, kernel=KERNEL))
  for i in {0, rows - 1}:
    np.testing.assert_array_equal(np.asarray(one_row(x[i:i + 1], w)),
                                  np.asarray(got[i:i + 1]))


@pytest.mark.parametrize("act_bits", [0, 8])
@pytest.mark.parametrize("rows", [1, 70])
def test_layer_loop_pick_reads_each_layers_format(act_bits, rows):
  # Every format as one "layer" of a loop: the kernel is handed all of
  # them and must read the picked one's own blocks (float16 scales of
  # Q8_0 and Q5_0 included) as `quantized.matmul` does; 70 rows take two
  # passes.
  ws = tuple(MATRICES[name].replace(act_bits=act_bits)
             for name in sorted(MATRICES))
  x = jax.random.normal(jax.random.key(rows), (rows, 512), jnp.float32)
  pick = jax.jit(KERNEL.pick)
  for i, w in enumerate(ws):
    got = pick(x, jnp.int32(i), ws)
    want = jax.jit(quantized.matmul)(x, w)
    _assert_rounding_close(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("rows", [1, 3, 9, 12, 33, 100])
def test_int8_activation_kernel_equals_the_xla_product(name, rows):
  """act_bits 8: the kernel's integer dot products equal XLA's product of
  the int8-quantized activations (`quantize_activations`) and the
  dequantised matrix, to accumulation-order rounding."""
  w = MATRICES[name].replace(act_bits=8)
  x = jax.random.normal(jax.random.key(rows), (rows, 512), jnp.float32)
  run = jax.jit(lambda x, w: quantized.matmul(x, w, kernel=KERNEL))
  got = np.asarray(run(x, w))
  want = np.asarray(jax.jit(quantized.matmul)(x, w))
  _assert_rounding_close(got, want)
  # Every row as a decode step computes it, bit for bit, whatever tiles
  # the X rows took (one, two or four weight rows a tile, or from 12 rows
  # AMX's tiles of 16 weight rows where `kernels.amx()`).
  for i in {0, rows - 1}:
    np.testing.assert_array_equal(np.asarray(run(x[i:i + 1], w)),
                                  got[i:i + 1])
  # Quantizing the activations moves the product by about its step (the
  # flag is not ignored), no more.
  exact = np.asarray(jax.jit(quantized.matmul)(x, MATRICES[name]))
  moved = np.abs(want - exact).max() / np.abs(exact).max()
  assert 1e-4 < moved < 3e-2, moved


def test_int8_products_take_amx_tiles_where_the_cpu_has_them():
  """A CPU listing AMX-INT8 gets its tiles (the row checks above then hold
  them to the one-row products, which never take them)."""
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  flags = next((line for line in cpuinfo.read_text().splitlines()
                if line.startswith("flags")), "") if cpuinfo.exists() else ""
  if not {"amx_tile", "amx_int8"} <= set(flags.split()):
    pytest.skip("the CPU has no AMX-INT8")
  assert kernels.amx()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "int4:g64:sym"])
def test_an_odd_output_count_leaves_a_one_row_tile(name):
  """41 outputs: float tiles of four weight rows leave one, which must sum
  in the same order (13 rows: weights dequantised once, then loaded by x
  rows in tiles of 4, 4 and 5: every row checked)."""
  w = jax.tree.map(lambda a: a[:41], MATRICES[name])
  x = jax.random.normal(jax.random.key(7), (13, 512), jnp.float32)
  run = jax.jit(lambda x, w: quantized.matmul(x, w, kernel=KERNEL))
  got = np.asarray(run(x, w))
  _assert_rounding_close(got, np.asarray(jax.jit(quantized.matmul)(x, w)))
  for r in range(13):
    np.testing.assert_array_equal(np.asarray(run(x[r:r + 1], w))[0], got[r])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_x_beyond_l2_sums_in_the_same_order(qtype):
  """x [60, 4608] (1.1 MB, more than the kernel keeps in L2): its float
  tiles take groups of x rows outer, each output still summed in the
  decode step's order; 41 outputs leave a one-row tile."""
  block, _ = gguf.GGML_QUANT_SIZES[qtype]
  w = jax.tree.map(jnp.asarray, gguf_blocks.from_blocks(
      random_blocks(qtype, 41, 4608 // block), qtype, "t", (4608, 41)))
  x = jax.random.normal(jax.random.key(3), (60, 4608), jnp.float32)
  run = jax.jit(lambda x, w: quantized.matmul(x, w, kernel=KERNEL))
  got = np.asarray(run(x, w))
  _assert_rounding_close(got, np.asarray(jax.jit(quantized.matmul)(x, w)))
  for r in (0, 8, 9, 59):
    np.testing.assert_array_equal(np.asarray(run(x[r:r + 1], w))[0], got[r])


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("g++"),
                    reason="GCC on x86-64")
def test_rows_agree_when_gcc_tunes_for_amd_cores_without_avx512(tmp_path):
  """Built as on a Zen 3 host (AVX2, GCC tuning for AMD cores, which
  keeps a product and its sum apart in some accumulation chains and not
  others), every output must still sum in one order whatever the number
  of x rows: the row-equality checks above, run on that build."""
  cxx = tmp_path / "cxx"
  cxx.write_text('#!/bin/sh\nexec g++ "$@" -mno-avx512f -mtune=znver3\n')
  cxx.chmod(0o755)
  env = dict(os.environ, CXX=str(cxx), SPECJAX_CACHE=str(tmp_path / "cache"))
  tests = [f"{__file__}::{name}" for name in (
      "test_kernel_equals_the_xla_product",
      "test_an_odd_output_count_leaves_a_one_row_tile",
      "test_x_beyond_l2_sums_in_the_same_order")]
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
      env=env, capture_output=True, text=True, check=False)
  assert run.returncode == 0, run.stdout[-3000:]
  assert "passed" in run.stdout and "skipped" not in run.stdout


def test_int8_activations_need_chunks_of_64_inputs():
  w = MATRICES["Q8_0"]
  x = jnp.ones((2, 480), jnp.float32)
  with pytest.raises(ValueError, match="int8 activations"):
    kernels.smallm_quantized(x, w.low[:, :480], w.scales[:, :15], None,
                             bits=8, group=32, offset=0,
                             int8_activations=True)


def test_nibble_groups_of_48_stay_on_xla():
  """A group of 48 nibbles is not two 16-byte runs: the kernel refuses it
  and the product falls back to XLA, with the dequantised values."""
  rng = np.random.default_rng(1)
  w = jax.tree.map(jnp.asarray, quantized.quantize_array(
      rng.normal(0, 1, (8, 96)).astype(np.float32),
      quantized.QuantSpec.parse("int4:g48"), "t"))
  assert not KERNEL.supports(w)
  x = jnp.asarray(rng.normal(0, 1, (3, 96)).astype(np.float32))
  got = jax.jit(lambda x, w: quantized.matmul(x, w, kernel=KERNEL))(x, w)
  _assert_rounding_close(np.asarray(got),
                         np.asarray(x) @ np.asarray(quantized.dequantize(w)).T)


def test_bad_high_bit_planes_are_refused():
  w = MATRICES["Q6_K"]
  x = jnp.ones((3, 512), jnp.float32)
  kw = dict(bits=6, group=w.group, offset=w.offset,
            super_scales=w.super_scales)
  with pytest.raises(ValueError, match="6-bit matrix"):
    kernels.smallm_quantized(x, w.low, w.scales, w.mins, **kw)  # no high
  with pytest.raises(ValueError, match="6-bit matrix"):
    kernels.smallm_quantized(x, w.low, w.scales, w.mins, high=w.high[:, :-1],
                             **kw)
  # The same check guards each layer of a layer loop's pick.
  good = dict(codes=w.low, scales=w.scales, mins=w.mins, high=w.high, **kw)
  with pytest.raises(ValueError, match="smallm_quantized_pick.*6-bit"):
    kernels.smallm_quantized_pick(x, jnp.int32(0),
                                  (good, dict(good, high=None)))


def test_two_level_scales_need_their_super_block_factors():
  """Q4_K's integer sub-scales and sub-mins are only scales with their
  float16 factors, one per super-block of 256 inputs."""
  w = MATRICES["Q4_K"]
  x = jnp.ones((3, 512), jnp.float32)
  kw = dict(codes=w.low, scales=w.scales, mins=w.mins, bits=4, group=32,
            offset=0, super_scales=w.super_scales, super_mins=w.super_mins)
  want = kernels.smallm_quantized(x, **kw)
  np.testing.assert_array_equal(
      np.asarray(kernels.smallm_quantized_pick(x, jnp.int32(0), (kw,))),
      np.asarray(want))
  bad = {"no super_scales": dict(kw, super_scales=None),
         "no super_mins": dict(kw, super_mins=None),
         "float32 super_scales": dict(
             kw, super_scales=w.super_scales.astype(jnp.float32)),
         "3 super-blocks for 16 groups": dict(
             kw, super_scales=w.super_scales[:, :1].repeat(3, axis=1)),
         "int8 mins": dict(kw, mins=w.mins.astype(jnp.int8))}
  for why, args in bad.items():
    with pytest.raises(ValueError, match=r"4-bit matrix of groups of 32"):
      kernels.smallm_quantized(x, **args)
      pytest.fail(why)


@pytest.mark.slow
def test_kernel_plan_on_a_quantized_model():
  """out_in/kernel on an int4 model: logits as on XLA to rounding, and
  greedy speculation equals generate (both through the kernel)."""
  target, draft = tiny.tiny_pair(seed=2)
  q = target.quantize("int4")
  qk = q.with_plan(cpu.plan("out_in/kernel"))
  tokens = jnp.array([[3, 17, 99, 4], [1, 2, 3, 4]])
  run = jax.jit(lambda m, t: m(t, m.init_cache(2, 8))[0].logits)
  _assert_rounding_close(np.asarray(run(qk, tokens)),
                         np.asarray(run(q, tokens)))
  prompts = [[5, 17, 99, 3], [42]]
  want = decode.generate(qk, prompts, max_new_tokens=9)
  got = decode.speculative_generate(qk, draft.quantize("int8"), prompts,
                                    gamma=3, max_new_tokens=9)
  np.testing.assert_array_equal(got.tokens, want.tokens)


@pytest.mark.parametrize("rows", [1, 3])
def test_hybrid_plan_sends_one_row_of_a_packed_matrix_to_the_kernel(rows):
  """"out_in/hybrid" leaves a float matrix's one-row product to XLA, but a
  packed matrix's goes to the kernel: XLA would dequantise all of it."""
  w = MATRICES["Q4_K"]
  plan = cpu.plan("out_in/hybrid")
  x = jnp.ones((rows, 512), jnp.float32)
  hlo = jax.jit(lambda x, w: matmul.project(x, w, plan)).lower(
      x, w).as_text()
  assert "specjax_smallm_quant" in hlo


def test_a_wide_pass_reads_the_packed_head_dequantised_once():
  """Past the kernel's rows the packed head is multiplied through XLA.
  `for_branches` dequantises it once, before a generation's loop, so
  that an adaptive step's width branches share it (XLA does not hoist it
  out of a branch); narrower passes, and a float head, leave the model as
  it is. The products and a generation's tokens are the same."""
  target, draft = tiny.tiny_pair(seed=2)
  q = target.quantize("int4").with_plan(cpu.plan("out_in/kernel"))
  name = "embed" if q.config.tie_embeddings else "lm_head"
  assert quantized.is_quantized(q.params[name])
  limit = q.plan.kernel_max_rows
  assert q.for_branches(limit) is q
  assert target.for_branches(limit + 1) is target
  wide = q.for_branches(limit + 1)
  np.testing.assert_array_equal(wide.params[name].dense,
                                quantized.dequantize(q.params[name]))
  assert wide.params[name].nbytes == q.params[name].nbytes
  hidden = jax.random.normal(jax.random.PRNGKey(0),
                             (limit + 1, q.config.hidden_size))
  logits = jax.jit(lambda m, h: m.logits(h))
  np.testing.assert_array_equal(logits(wide, hidden), logits(q, hidden))
  # Nine rows of γ + 1 = 4: 36 rows a pass, past the kernel's 32.
  prompts = [[5 + i, 17, 99, 3] for i in range(9)]
  want = decode.generate(q, prompts, max_new_tokens=6)
  got = decode.speculative_generate(q, draft.quantize("int8"), prompts,
                                    gamma=3, max_new_tokens=6)
  np.testing.assert_array_equal(got.tokens, want.tokens)
