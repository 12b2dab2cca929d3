"""Speculation on quantized models is exact with respect to the quantized
target: greedy equality with its own `generate`, and its exact sampling
distribution, step by step (the `test_step_distribution` pattern on tiny
transformers whose matrices are int4 / int8 / GGUF Q8_0 blocks).

Shape letters: V vocab.
"""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu
from specjax import decode
from specjax import policies
from specjax import speculate
from specjax import testing
from specjax.checkpoints import gguf_blocks
from specjax.drafters import DraftModel
from specjax.models import config as config_lib
from test_distribution import _chi_square
from test_distribution import _exact_joint
from test_distribution import _peaked
from test_distribution import NUM_SAMPLES
from test_distribution import NUM_TOKENS
from test_distribution import PROMPT
from test_step_distribution import _start
from test_step_distribution import _step
from test_step_distribution import synthetic

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 13


def _q8_0(model):
  """Every matrix of `model` (and its embedding) as GGUF Q8_0 blocks made
  by the gguf package's own quantizer."""
  flat = config_lib.flatten(model.params)
  transposed = set(config_lib.matrix_paths(model.config))
  for path in [*transposed, "embed"]:
    w = np.asarray(flat[path])
    rows_first = w.T if path in transposed else w  # [O, I]
    data = gguf.quants.quantize(np.ascontiguousarray(rows_first),
                                gguf.GGMLQuantizationType.Q8_0)
    flat[path] = jax.tree.map(jnp.asarray, gguf_blocks.from_blocks(
        data, gguf.GGMLQuantizationType.Q8_0, path, w.shape))
  return model.replace(params=config_lib.unflatten(
      model.config, lambda p, _: flat[p]))


@pytest.fixture(scope="module")
def models_():
  target, draft = testing.tiny_pair(seed=4)
  return target, draft


# Whole generations: int4 in the slow step, q8_0 with `-m extended`; the
# default suite keeps the step-level sampling test.
@pytest.mark.parametrize("kind", [
    pytest.param("int4", marks=pytest.mark.slow),
    pytest.param("q8_0", marks=(pytest.mark.slow, pytest.mark.extended))])
def test_greedy_speculation_equals_the_quantized_targets_generate(models_,
                                                                  kind):
  target, draft = models_
  quant = target.quantize("int4") if kind == "int4" else _q8_0(target)
  want = decode.generate(quant, PROMPTS, max_new_tokens=MAX_NEW)
  # The float target's own output differs: equality below is not trivial.
  other = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  if kind == "int4":
    assert not np.array_equal(want.tokens, other.tokens)
  # A quantized draft, and the float target drafting for its quantized self.
  for d in (draft.quantize("int8"), target):
    got = decode.speculative_generate(quant, d, PROMPTS, gamma=3,
                                      max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)


def test_greedy_speculation_on_an_int8_activation_target(models_):
  """int4 weights with int8 activations (llama.cpp's arithmetic) through
  the CPU kernel where it is available: speculation equals the target's
  own greedy generate (a model whose logits are not its int4 self's);
  exact on the kernel's plan (`Model.int8_rounding`), on XLA's only up to
  rounding."""
  target, draft = models_
  plan = "out_in/kernel" if cpu.SMALLM.available() else "in_out/xla"
  quant = target.quantize("int4:a8").with_plan(cpu.plan(plan))
  assert quant.int8_rounding == (plan == "in_out/xla")
  tokens = jnp.asarray([PROMPTS[0]])
  logits = lambda m: np.asarray(m(tokens, m.init_cache(1, 8))[0].logits)
  assert np.abs(logits(quant) - logits(quant.with_activations(0))).max() > 0
  want = decode.generate(quant, PROMPTS, max_new_tokens=MAX_NEW)
  got = decode.speculative_generate(quant, draft, PROMPTS, gamma=3,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)


def _rows_apart(model, prompt_width, chunk):
  """The prompt [1, prompt_width] prefilled (in chunks of 64 from 128),
  then `chunk` tokens in one pass and one at a time: per row, the largest
  difference of their hidden states [T]."""
  lengths = jnp.asarray([prompt_width - 3], jnp.int32)
  prompt = jnp.arange(prompt_width, dtype=jnp.int32)[None] % 97
  cache = model.init_cache(1, prompt_width + chunk + 8)
  _, cache = jax.jit(type(model).prefill)(model, prompt, lengths, cache)
  forward = jax.jit(lambda m, t, c: m.forward(t, c))
  tokens = (jnp.arange(chunk, dtype=jnp.int32)[None] * 7 + 3) % 97
  together = np.asarray(forward(model, tokens, cache).hidden[0])
  alone = []
  for t in range(chunk):
    out = forward(model, tokens[:, t:t + 1], cache)
    cache = out.cache
    alone.append(np.asarray(out.hidden[0, 0]))
  return np.abs(together - np.stack(alone)).max(axis=-1)


def test_an_int8_activation_pass_reproduces_its_decode_steps(models_):
  """A 5-token pass (attention rows written out) and a 20-token one (in a
  loop) after a short and a chunked prompt, against the same tokens one
  at a time, on int4 weights with int8 activations through the kernel:
  every row's hidden state equal bit for bit. Attention over all rows at
  once (`MatmulPlan.row_invariant` off) rounds them apart, and int8 codes
  carry that on."""
  if not cpu.SMALLM.available():
    pytest.skip("needs the CPU kernel: XLA's int8 products are not "
                "row-invariant")
  quant = models_[0].quantize("int4:a8").with_plan(cpu.plan("out_in/kernel"))
  assert quant.plan.row_invariant and not quant.int8_rounding
  for width, chunk in ((7, 5), (128, 20)):
    np.testing.assert_array_equal(_rows_apart(quant, width, chunk), 0)
  at_once = quant.replace(plan=dataclasses.replace(quant.plan,
                                                   row_invariant=False))
  assert at_once.int8_rounding
  assert _rows_apart(at_once, 7, 5).max() > 0


def test_row_invariant_attention_is_left_to_kernel_plans(models_):
  """On an XLA plan, whose int8 products group a pass's sums by its rows
  anyway, `with_activations(8)`'s row-invariant flag buys no exactness:
  the pass keeps attention over all rows at once, bit for bit."""
  quant = models_[0].quantize("int4:a8")
  assert quant.plan.row_invariant and not quant.plan.kernel
  assert quant.int8_rounding
  at_once = quant.replace(plan=dataclasses.replace(quant.plan,
                                                   row_invariant=False))
  lengths = jnp.asarray([4], jnp.int32)
  prompt = jnp.arange(7, dtype=jnp.int32)[None] % 97
  tokens = (jnp.arange(5, dtype=jnp.int32)[None] * 7 + 3) % 97

  def pass_(model):
    cache = model.init_cache(1, 20)
    _, cache = jax.jit(type(model).prefill)(model, prompt, lengths, cache)
    return np.asarray(jax.jit(lambda m, t, c: m.forward(t, c).hidden)(
        model, tokens, cache))

  np.testing.assert_array_equal(pass_(quant), pass_(at_once))


@pytest.fixture(scope="module")
def quantized_pair():
  target = _peaked(testing.TINY_TARGET, 0).quantize("int4")
  draft = _peaked(testing.TINY_DRAFT, 1).quantize("int8")
  return target, draft


def _samples(target, draft, seed, synthetic_acceptance=None):
  """[NUM_SAMPLES, NUM_TOKENS]: one jitted prefill, then jitted steps."""
  params = speculate.StepParams.create(
      temperature=1.0, top_k=0, top_p=1.0,
      acceptance=synthetic(synthetic_acceptance))
  prompts = jnp.tile(jnp.asarray([PROMPT], jnp.int32), (NUM_SAMPLES, 1))
  lengths = jnp.full((NUM_SAMPLES,), len(PROMPT), jnp.int32)
  drafter, policy = DraftModel(draft), policies.Fixed(2)
  state = _start(target, drafter, policy, params, prompts, lengths,
                 jax.random.key(seed))
  for _ in range(NUM_TOKENS - 1):
    state = _step(state, target, drafter, policy, params)
  assert np.all(np.asarray(state.num_generated) == NUM_TOKENS)
  return np.asarray(state.tokens[:, :NUM_TOKENS])


def test_step_samples_follow_the_quantized_target(quantized_pair):
  target, draft = quantized_pair
  joint = _exact_joint(target, (1.0, 0, 1.0))
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  stat, critical = _chi_square(_samples(target, draft, seed=5), joint)
  assert stat < critical, (stat, critical)


@pytest.mark.slow
def test_the_test_rejects_unverified_quantized_drafts(quantized_pair):
  """Accepting every draft token unverified gives the draft's law."""
  target, draft = quantized_pair
  joint = _exact_joint(target, (1.0, 0, 1.0))
  samples = _samples(target, draft, seed=6, synthetic_acceptance=1.0)
  stat, critical = _chi_square(samples, joint)
  assert stat > critical, (stat, critical)
