"""Mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Shape letters: B batch, T chunk, S cache size, V vocab, X experts, k
experts per token, E hidden, F expert MLP size.

The reference is transformers itself (float32, eager attention) on tiny
random checkpoints it saves; speculative outputs must equal `generate`'s
token for token, and sampled ones the target's exact law (by enumeration,
as test_distribution.py). A decode step must read only its tokens'
experts: its program may touch the stacked experts only by gathering k of
them per token. The fewer-experts self-draft (`moe.fewer_experts`) is
checked against transformers run with fewer experts per token, and GGUF
files against transformers on the weights they hold, written as llama.cpp
names and stacks them (gguf's own tensor name map).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax import cpu
from specjax import decode
from specjax import drafters
from specjax import metrics
from specjax import models
from specjax import registry
from specjax import sharding
from specjax import testing
from specjax.checkpoints import convert
from specjax.checkpoints import gguf as gguf_lib
from specjax.checkpoints import hf
from specjax.cpu import kernels
from specjax.models import moe
from tests import test_distribution as dist

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ATOL = 1e-4
B, S = 2, 24
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, tie_word_embeddings=False,
               attn_implementation="eager")


def tiny_moe_hf_config(arch: str):
  """A tiny transformers MoE config: 8 experts, top-2. Qwen2-MoE has its
  shared expert; Qwen3-MoE renormalises the top-k (norm_topk_prob), the
  others' norm_topk_prob stays False (Mixtral always renormalises)."""
  import transformers  # pylint: disable=g-import-not-at-top
  if arch == "mixtral":
    return transformers.MixtralConfig(**_COMMON, num_local_experts=8,
                                      num_experts_per_tok=2)
  if arch == "qwen2_moe":
    return transformers.Qwen2MoeConfig(
        **_COMMON, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48)
  if arch == "qwen3_moe":
    return transformers.Qwen3MoeConfig(
        **_COMMON, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True)
  return transformers.OlmoeConfig(**_COMMON, num_experts=8,
                                  num_experts_per_tok=2, eos_token_id=None,
                                  pad_token_id=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """arch -> (specjax Model, float32 torch model), every parameter
  redrawn (norms around one) and saved by `save_pretrained`."""
  import transformers  # pylint: disable=g-import-not-at-top
  built = {}

  def make(arch):
    if arch not in built:
      torch.manual_seed(ARCHS.index(arch))
      model = transformers.AutoModelForCausalLM.from_config(
          tiny_moe_hf_config(arch)).to(torch.float32)
      with torch.no_grad():
        for name, p in model.named_parameters():
          p.copy_(0.15 * torch.randn_like(p)
                  + (1.0 if name.endswith("norm.weight") else 0.0))
      directory = os.fspath(tmp_path_factory.mktemp(f"hf_{arch}"))
      model.eval().save_pretrained(directory)
      built[arch] = (hf.load_hf(directory), model)
    return built[arch]

  return make


def _hf_logits(torch_model, tokens) -> np.ndarray:
  with torch.no_grad():
    return torch_model(torch.tensor(np.asarray(tokens))).logits.numpy()


@jax.jit
def _step(model, tokens, cache):
  out, cache = model(tokens, cache)
  return out.logits, cache


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_cached_decode_and_greedy_match_transformers(checkpoint,
                                                            arch):
  model, torch_model = checkpoint(arch)
  assert model.config.num_experts == 8 and model.config.arch == arch
  tokens = np.random.default_rng(1).integers(0, 128, (B, 10))
  want = _hf_logits(torch_model, tokens)  # [B, T, V]
  # A prefill chunk of 6, then one token at a time: cached decode equals
  # transformers' full forward at every position.
  logits, cache = _step(model, jnp.asarray(tokens[:, :6]),
                        model.init_cache(B, S))
  got = [np.asarray(logits)]
  for t in range(6, 10):
    logits, cache = _step(model, jnp.asarray(tokens[:, t:t + 1]), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, 1), want, atol=ATOL)
  # Greedy, token for token: transformers' argmax over its full forward,
  # and ours over the cache (the same programs as above). `generate`
  # itself runs on an MoE target in the speculative tests below.
  seqs = ours = tokens[:, :6]
  logits, cache = _step(model, jnp.asarray(ours), model.init_cache(B, S))
  for _ in range(6):
    seqs = np.concatenate(
        [seqs, _hf_logits(torch_model, seqs)[:, -1:].argmax(-1)], 1)
    nxt = np.asarray(logits)[:, -1:].argmax(-1)  # [B, 1]
    ours = np.concatenate([ours, nxt], 1)
    logits, cache = _step(model, jnp.asarray(nxt, jnp.int32), cache)
  np.testing.assert_array_equal(ours, seqs)


@pytest.mark.parametrize("arch", [
    "mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_a_pass_counts_the_experts_transformers_routes_to(checkpoint, arch):
  """`ModelOutput.experts`: the distinct experts of each layer's top-k
  over the chunk's tokens, summed over layers, as transformers' own
  router logits choose them (a chunk of 5 tokens over B rows, then one
  token of one row)."""
  model, torch_model = checkpoint(arch)
  k = model.config.num_experts_per_tok
  tokens = np.random.default_rng(2).integers(0, 128, (B, 5))
  for chunk in (tokens, tokens[:1, :1]):
    with torch.no_grad():
      routers = torch_model(torch.as_tensor(chunk),
                            output_router_logits=True).router_logits
    want = sum(len(np.unique(np.asarray(r).argsort(-1)[:, -k:]))
               for r in routers)
    out, _ = model(jnp.asarray(chunk), model.init_cache(chunk.shape[0], S))
    assert int(out.experts) == want
  # A dense model counts none.
  dense = models.init_random(testing.TINY_DRAFT, jax.random.key(1))
  out, _ = dense(jnp.asarray(tokens), dense.init_cache(B, S))
  assert out.experts is None


def test_strategies_compute_the_same_function():
  config = models.ModelConfig(
      arch="qwen3_moe", vocab_size=16, hidden_size=16, intermediate_size=8,
      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, num_experts=6,
      num_experts_per_tok=3, norm_topk_prob=True)
  keys = jax.random.split(jax.random.key(0), 5)
  ws = moe.Experts(gate=jax.random.normal(keys[0], (6, 8, 16)),
                   up=jax.random.normal(keys[1], (6, 8, 16)),
                   down=jax.random.normal(keys[2], (6, 8, 16)))
  x = jax.random.normal(keys[3], (3, 5, 16))
  logits = jax.random.normal(keys[4], (3, 5, 6))
  apply = jax.jit(moe.apply_experts, static_argnums=(3, 4))
  outs = {how: np.asarray(apply(x, logits, ws, config, how)[0])
          for how in moe.STRATEGIES}
  for how in ("loop", "grouped", "dense", "ragged"):
    np.testing.assert_allclose(outs[how], outs["gather"], rtol=1e-5,
                               atol=1e-4)
  # The grouped loop over tiles of 1, 2 and 4 of an expert's rows (15
  # rows, 45 pairs over 6 experts: several tiles each, the last ragged).
  weights, experts = moe.route(logits.reshape(15, 6), 3, True)
  loop = moe.experts_loop(x.reshape(15, 16), experts, weights, ws,
                          config.activation)
  for tile in (1, 2, 4):
    np.testing.assert_allclose(
        moe.experts_grouped(x.reshape(15, 16), experts, weights, ws,
                            config.activation, tile=tile), loop,
        rtol=1e-5, atol=1e-5)
  # Routing by hand: softmax, top 3, renormalised.
  probs = np.asarray(jax.nn.softmax(logits[0, 0]))
  top = np.argsort(-probs)[:3]
  weights, experts = moe.route(logits[0, :1], 3, True)
  np.testing.assert_array_equal(np.asarray(experts)[0], top)
  np.testing.assert_allclose(np.asarray(weights)[0],
                             probs[top] / probs[top].sum(), rtol=1e-6)
  assert moe.strategy(1, "tpu") == moe.strategy(16, "cpu") == "loop"
  assert moe.strategy(17, "cpu") == moe.strategy(512, "cpu") == "grouped"
  assert moe.strategy(512, "tpu") == "ragged"
  chosen = jnp.array([[3, 1], [1, 3], [5, 3]])
  np.testing.assert_array_equal(moe.distinct_experts(chosen, 6),
                                [1, 3, 5, 6, 6, 6])
  assert int(moe.count_distinct(chosen, 6)) == 3


# A tiny Mixtral-shaped target with random weights, and its dense draft.
TINY_MOE = models.ModelConfig(
    arch="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, router_weights_float32=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 8, 5, 6], [42], [7, 8, 9, 10, 11, 12]]
MAX_NEW = 12


def _moe_model(config, seed, expert_scale=1.0):
  """A random model whose router logits spread over a few nats, so that
  tokens choose different experts (each expert's matrices times
  `expert_scale`)."""
  model = models.init_random(config, jax.random.key(seed))
  params = model.canonical_params()
  for i in range(config.num_layers):
    layer = dict(params[f"layers_{i}"])
    layer["router"] = layer["router"] * 50.0
    for name in ("experts_gate", "experts_up", "experts_down"):
      layer[name] = layer[name] * expert_scale
    params = dict(params, **{f"layers_{i}": layer})
  return model.replace(params=params).with_plan(model.plan)


@pytest.fixture(scope="module")
def moe_pair():
  target = _moe_model(TINY_MOE, 0)
  draft = models.init_random(testing.TINY_DRAFT, jax.random.key(1))
  return target, draft


@pytest.fixture(scope="module")
def moe_baseline(moe_pair):
  return decode.generate(moe_pair[0], PROMPTS, max_new_tokens=MAX_NEW)


# The default suite keeps the draft model; lookup and trees run slow.
@pytest.mark.parametrize("kind", [
    "model", pytest.param("lookup", marks=pytest.mark.slow),
    pytest.param("tree", marks=pytest.mark.slow)])
def test_speculative_greedy_equals_generate(moe_pair, moe_baseline, kind):
  target, draft = moe_pair
  if kind == "lookup":
    draft = drafters.PromptLookup(target.vocab_size)
  extra = {"num_nodes": 8} if kind == "tree" else {}
  out = decode.speculative_generate(target, draft, PROMPTS, gamma=3,
                                    max_new_tokens=MAX_NEW, **extra)
  np.testing.assert_array_equal(out.tokens, moe_baseline.tokens)
  np.testing.assert_array_equal(out.lengths, moe_baseline.lengths)
  # Each verification pass's distinct experts are counted: over 3 rows
  # of up to 4 tokens, more than a decode step's k per layer, at most X.
  c = target.config
  per_pass = metrics.experts_per_pass(out.stats, c.num_layers)
  assert int(out.stats.expert_passes) == int(out.stats.steps) > 0
  assert c.num_experts_per_tok < per_pass <= c.num_experts
  summary = metrics.summarize(out)
  assert summary["experts_per_pass_all_layers"] == pytest.approx(
      per_pass * c.num_layers)
  assert metrics.experts_per_pass(decode.SpecStats.zeros(1, 3, 4)) is None


@pytest.fixture(scope="module")
def self_target():
  """A target whose experts outweigh the rest of its residual stream, so
  that its top-1 self-draft's argmax often differs; and its greedy
  output."""
  target = _moe_model(TINY_MOE, 0, expert_scale=4.0)
  return target, decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)


# The fewer-experts self-draft: the target routing to its top 1, alone,
# falling back from prompt lookup, and growing token trees.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chain", "lookup", "tree"])
def test_self_draft_greedy_equals_generate(self_target, kind):
  target, want = self_target
  draft = drafters.DraftModel(moe.fewer_experts(target, 1))
  if kind == "lookup":
    draft = drafters.Fallback(drafters.PromptLookup(target.vocab_size),
                              draft)
  extra = {"num_nodes": 8} if kind == "tree" else {}
  out = decode.speculative_generate(target, draft, PROMPTS, gamma=3,
                                    max_new_tokens=MAX_NEW, **extra)
  np.testing.assert_array_equal(out.tokens, want.tokens)
  np.testing.assert_array_equal(out.lengths, want.lengths)
  if kind == "chain":  # drafts are both accepted and rejected
    assert 0 < metrics.acceptance_rate(out.stats) < 1


@pytest.mark.slow
def test_self_draft_greedy_equals_generate_unnormalised_shared_expert():
  """Qwen2-MoE's routing: top-1 weights are the raw top probability (no
  renormalisation), plus the shared expert."""
  target = _moe_model(TINY_MOE.replace(
      arch="qwen2_moe", shared_expert_size=48, norm_topk_prob=False,
      router_weights_float32=False), 2, expert_scale=4.0)
  want = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  out = decode.speculative_generate(
      target, moe.fewer_experts(target, 1), PROMPTS, gamma=3,
      max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, want.tokens)
  np.testing.assert_array_equal(out.lengths, want.lengths)
  assert 0 < metrics.acceptance_rate(out.stats) < 1


def test_fewer_experts_shares_the_targets_arrays(moe_pair):
  target = moe_pair[0]
  c = target.config
  draft = moe.fewer_experts(target, 1)
  assert draft.config == c.replace(num_experts_per_tok=1)
  assert draft.plan == target.plan
  pairs = zip(jax.tree.leaves(draft.params), jax.tree.leaves(target.params))
  assert all(a is b for a, b in pairs)  # no copy
  # It reads one expert per layer fewer, and is priced apart.
  expert = 3 * c.hidden_size * c.intermediate_size * 4
  assert target.weight_bytes_per_token - draft.weight_bytes_per_token == (
      c.num_layers * expert)
  assert draft.cost_geometry().key != target.cost_geometry().key
  for k in (0, 2, 1.5, True):
    with pytest.raises(ValueError, match=r"in \[1, 2\) .* got"):
      moe.fewer_experts(target, k)
  dense = models.Model(config=testing.TINY_DRAFT, params={})
  with pytest.raises(ValueError, match="dense"):
    moe.fewer_experts(dense, 1)


def test_draft_experts_config(moe_pair):
  import ml_collections  # pylint: disable=g-import-not-at-top
  from configs import llama_pair  # pylint: disable=g-import-not-at-top
  from experiments import pair  # pylint: disable=g-import-not-at-top
  from experiments import validation  # pylint: disable=g-import-not-at-top
  target = moe_pair[0]
  config = ml_collections.ConfigDict(dict(
      target="tiny-moe", draft="same", draft_quantize="", draft_experts=1))
  draft = pair._same(config, target, None)
  assert draft.config.num_experts_per_tok == 1
  assert draft.params is target.params
  config.draft_experts = 2
  with pytest.raises(validation.ConfigError,
                     match=r"config.draft_experts=2 .*\[1, 2\)"):
    pair._same(config, target, None)
  config.draft_experts = 1
  dense = models.Model(config=testing.TINY_TARGET, params={})
  with pytest.raises(validation.ConfigError, match="draft_experts.*dense"):
    pair._same(config, dense, None)
  # Checked before loading: an integer >= 0, with draft=same and a
  # target that may be a mixture of experts (the tiny one is dense).
  for arg, bad in (("pair=tiny,draft_experts=1", "draft='same'"),
                   ("pair=qwen,draft_experts=1", "draft='same'")):
    with pytest.raises(validation.ConfigError, match=bad):
      validation.validate_config(llama_pair.get_config(arg))
  good = llama_pair.get_config("pair=qwen,draft_experts=1")
  good.draft = "same"
  validation.validate_config(good)
  good.draft_experts = -1
  with pytest.raises(validation.ConfigError, match="integer >= 0"):
    validation.validate_config(good)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fewer_experts_match_transformers_top_k(checkpoint, arch):
  """The self-draft is the target's checkpoint as transformers runs it
  with num_experts_per_tok=1 (Mixtral's and Qwen3-MoE's renormalised
  single weight is one; Qwen2-MoE's and OLMoE's the top probability)."""
  import transformers  # pylint: disable=g-import-not-at-top
  model, torch_model = checkpoint(arch)
  hf_config = tiny_moe_hf_config(arch)
  hf_config.num_experts_per_tok = 1
  top1 = transformers.AutoModelForCausalLM.from_config(hf_config).to(
      torch.float32).eval()
  top1.load_state_dict(torch_model.state_dict())
  tokens = np.random.default_rng(2).integers(0, 128, (B, 10))
  want = _hf_logits(top1, tokens)
  assert np.abs(want - _hf_logits(torch_model, tokens)).max() > 0.1
  draft = moe.fewer_experts(model, 1)
  logits, _ = _step(draft, jnp.asarray(tokens), draft.init_cache(B, S))
  np.testing.assert_allclose(logits, want, atol=ATOL)


def _consumers(jaxpr, var):
  """The equations of `jaxpr` (recursively) that read `var`, with the
  jaxpr variable each sub-jaxpr binds it to."""
  found = []
  for eqn in jaxpr.eqns:
    for i, v in enumerate(eqn.invars):
      if v is not var:
        continue
      if eqn.primitive.name == "while":  # cond consts, body consts, carry
        sub, at = eqn.params["body_jaxpr"].jaxpr, (
            i - eqn.params["cond_nconsts"])
        if at >= 0:
          found += _consumers(sub, sub.invars[at])
        continue
      inner = [p for p in eqn.params.values()
               if isinstance(p, (jax.extend.core.ClosedJaxpr,
                                 jax.extend.core.Jaxpr))]
      if inner:
        sub = getattr(inner[0], "jaxpr", inner[0])
        found += _consumers(sub, sub.invars[i])
      else:
        found.append(eqn)
  return found


@pytest.mark.parametrize("quantize, packed", [(None, 1), ("int4", 3)])
def test_decode_step_reads_only_the_active_experts(moe_pair, quantize,
                                                   packed):
  """Each expert stack (each packed array of a quantized one: int4's
  codes, scales and mins) is read one expert at a time."""
  target = moe_pair[0]
  if quantize:
    target = target.quantize(quantize)
  c = target.config
  cache = target.init_cache(1, 8)
  tokens = jnp.ones((1, 1), jnp.int32)
  closed = jax.make_jaxpr(lambda p: target.replace(params=p)(tokens, cache)
                          )(target.params)
  leaves = jax.tree_util.tree_flatten_with_path(target.params)[0]
  expert_vars = [v for (path, _), v in zip(leaves, closed.jaxpr.invars)
                 if "experts_" in jax.tree_util.keystr(path)]
  assert len(expert_vars) == 3 * c.num_layers * packed
  for var in expert_vars:
    uses = _consumers(closed.jaxpr, var)
    assert uses, "an expert stack is never read"
    for eqn in uses:
      # Only indexed one expert at a time ([in, out] or [1, in, out]),
      # inside the loop over the distinct chosen experts, whose trip
      # count (at most k for one token) `distinct_experts` gives.
      assert eqn.primitive.name in ("gather", "dynamic_slice"), eqn
      shape = eqn.outvars[0].aval.shape
      assert int(np.prod(shape)) * c.num_experts == int(
          np.prod(var.aval.shape)), eqn


def test_scan_layout_equals_per_layer(moe_pair):
  target = moe_pair[0]
  scanned = target.with_plan("in_out/xla/scan")
  assert scanned.params["layers"]["experts_gate"].shape == (
      2, 8, 32, 64)  # [L, X, F, E]
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 128, (B, 7)))
  want, _ = _step(target, tokens, target.init_cache(B, S))
  got, _ = _step(scanned, tokens, scanned.init_cache(B, S))
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernels")
def test_kernel_plan_reads_experts_in_place(moe_pair):
  """out_in/kernel: the expert loop multiplies each chosen expert in the
  kernel, where it lies in the [X, F, E] stack (no copy of its slice in
  the program); logits as XLA's to rounding, and greedy speculation on
  that plan equals its `generate`."""
  target, draft = moe_pair
  kernel = target.with_plan(cpu.plan("out_in/kernel"))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 128, (B, 5)))
  run = jax.jit(_step)
  want, _ = run(target, tokens, target.init_cache(B, S))
  got, _ = run(kernel, tokens, kernel.init_cache(B, S))
  np.testing.assert_allclose(got, want, atol=1e-5)
  hlo = run.lower(kernel, tokens, kernel.init_cache(B, S)).as_text()
  # Three picks per layer (gate, up, down), each inside its expert loop.
  assert hlo.count("specjax_smallm_pick") == 3 * TINY_MOE.num_layers, hlo
  want = decode.generate(kernel, PROMPTS, max_new_tokens=MAX_NEW)
  got = decode.speculative_generate(kernel, draft, PROMPTS, gamma=3,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(got.tokens, want.tokens)


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:g32:sym"])
@pytest.mark.parametrize("plan", [
    "in_out/xla", "in_out/xla/scan",
    pytest.param("out_in/kernel", marks=pytest.mark.skipif(
        not kernels.available(), reason="no CPU kernels"))])
def test_quantized_experts_equal_their_dequantised_values(moe_pair, spec,
                                                         plan):
  """`Model.quantize` packs every expert stack; a pass equals the float
  model holding the values they dequantise to (per layer, scanned, and in
  the kernel, which reads each chosen expert's packed rows in place)."""
  target = moe_pair[0].with_plan(cpu.plan(plan)).quantize(spec)
  layers = (target.params["layers"] if "scan" in plan
            else target.params["layers_1"])
  for name in ("experts_gate", "experts_up", "experts_down"):
    assert models.is_quantized(layers[name]), name
    assert layers[name].shape == (8, 32, 64)  # the logical [X, F, E]
  reference = target.dequantized()
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 128, (B, 7)))
  run = jax.jit(_step)
  want, _ = run(reference, tokens, reference.init_cache(B, S))
  got, _ = run(target, tokens, target.init_cache(B, S))
  np.testing.assert_allclose(got, want, atol=1e-5)
  if plan == "out_in/kernel":
    hlo = run.lower(target, tokens, target.init_cache(B, S)).as_text()
    # Three stacked picks per layer: gate, up and down.
    assert hlo.count("specjax_smallm_quant_pick") == (
        3 * TINY_MOE.num_layers), hlo


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernels")
def test_quantized_experts_speculation_equals_generate(moe_pair):
  """Greedy speculation on an int4 MoE target in the kernel plan equals
  that target's `generate`, token for token."""
  target = moe_pair[0].with_plan(cpu.plan("out_in/kernel")).quantize("int4")
  want = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  got = decode.speculative_generate(target, moe_pair[1], PROMPTS, gamma=3,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_quantized_expert_bytes_count_the_packed_arrays(moe_pair):
  target = moe_pair[0].quantize("int8")
  c = target.config
  # int8 codes plus a float32 scale per output row, per expert matrix.
  per_expert = (3 * c.hidden_size * c.intermediate_size
                + 4 * (2 * c.intermediate_size + c.hidden_size))
  assert moe.expert_bytes(c, target.params) == c.num_layers * per_expert


def test_partition_rules_cover_every_expert_parameter():
  mesh = sharding.make_mesh(data=1, model=1)
  config = TINY_MOE.replace(arch="qwen2_moe", shared_expert_size=48,
                            router_weights_float32=False)
  specs = sharding.rules.param_specs(config, mesh)
  assert len(specs["layers_0"]["experts_gate"]) == 3
  assert len(specs["layers_0"]["experts_down"]) == 3
  assert "shared_expert_gate" in specs["layers_1"]


def test_inactive_expert_bytes_prices_k_of_x_experts(moe_pair):
  target = moe_pair[0]
  c = target.config
  per_layer = 3 * c.num_experts * c.hidden_size * c.intermediate_size * 4
  assert moe.inactive_expert_bytes(c, target.params) == (
      c.num_layers * per_layer * (c.num_experts - 2) // c.num_experts)
  dense = sum(x.nbytes for x in jax.tree.leaves(target.params)) - (
      target.params["embed"].nbytes)
  assert target.weight_bytes_per_token == dense - (
      c.num_layers * per_layer * (c.num_experts - 2) // c.num_experts)
  # An early exit after layer 1 of L reads the active experts of one
  # layer: what is not a layer, plus one layer's share.
  layers = sum(x.nbytes for k, v in target.params.items()
               if k.startswith("layers") for x in jax.tree.leaves(v))
  active = layers - moe.inactive_expert_bytes(c, target.params)
  subset = models.LayerSubset.create(target, exit_layer=1)
  assert subset.weight_bytes_per_token == (
      target.weight_bytes_per_token - active + active // c.num_layers)


@pytest.mark.parametrize("config, missing", [
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "latent attention"),
    ({"model_type": "deepseek_v2"}, "grouped routing"),
    ({"architectures": ["GptOssForCausalLM"]}, "attention sinks"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 8,
      "num_attention_heads": 2, "num_hidden_layers": 2,
      "mlp_only_layers": [1]}, "dense MLP layers"),
    ({"architectures": ["OlmoeForCausalLM"], "hidden_size": 8,
      "num_attention_heads": 2, "num_hidden_layers": 2, "clip_qkv": 8.0},
     "clip_qkv"),
])
def test_unsupported_moe_variants_name_what_is_missing(config, missing):
  with pytest.raises(ValueError, match=missing):
    convert.config_from_hf(config)


# GGUF files as llama.cpp's converter writes them: gguf's own tensor name
# map, the experts stacked [X, out, in], Mixtral as `llama` with permuted
# Q/K rows.
_GGUF_ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe",
               "qwen3_moe": "qwen3moe"}


def _write_moe_gguf(path, arch, model, torch_model, quantized=False):
  """Writes `torch_model` (a `checkpoint`) as a GGUF file; with
  `quantized`, experts, shared expert and q in Q8_0 (rows of 32n only).

  Returns:
    HF name -> float32 values the file holds (dequantised).
  """
  import gguf  # pylint: disable=g-import-not-at-top
  from tests import test_gguf  # pylint: disable=g-import-not-at-top
  c = model.config
  file_arch = _GGUF_ARCHS[arch]
  names = gguf.get_tensor_name_map(
      gguf.MODEL_ARCH[file_arch.upper()], c.num_layers)
  writer = gguf.GGUFWriter(str(path), file_arch)
  # A Qwen-MoE's feed_forward_length is its (unused) dense MLP size.
  test_gguf.add_geometry(
      writer, layers=c.num_layers, context=c.max_position_embeddings,
      hidden=c.hidden_size,
      ffn=c.intermediate_size if arch == "mixtral" else 4 * c.hidden_size,
      heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
      rope_theta=c.rope_theta, eps=c.rms_norm_eps)
  writer.add_expert_count(c.num_experts)
  writer.add_expert_used_count(c.num_experts_per_tok)
  if arch != "mixtral":
    writer.add_expert_feed_forward_length(c.intermediate_size)
  if c.shared_expert_size:
    writer.add_expert_shared_feed_forward_length(c.shared_expert_size)
  tensors = {}
  for name, w in torch_model.state_dict().items():
    w = w.numpy()
    if name.endswith("experts.gate_up_proj"):  # [X, 2F, E], gate first
      f = w.shape[1] // 2
      stem = name[:-len("gate_up_proj")]
      tensors[stem + "gate_proj"], tensors[stem + "up_proj"] = (
          w[:, :f], w[:, f:])
    else:
      tensors[name] = w
  held = {}
  for name, w in tensors.items():
    # (llama.cpp names the stacked experts `...experts.w1.weight`.)
    suffixed = name if name.endswith(("weight", "bias")) else name + ".weight"
    gname = names.get_name(suffixed, try_suffixes=(".weight", ".bias"))
    stored = w
    if arch == "mixtral" and ".q_proj." in name:
      stored = test_gguf.llama_cpp_permute(w, c.num_heads, c.num_heads)
    elif arch == "mixtral" and ".k_proj." in name:
      stored = test_gguf.llama_cpp_permute(w, c.num_heads, c.num_kv_heads)
    if name.endswith("shared_expert_gate.weight"):
      stored = w[0]  # llama.cpp's [E]
    if quantized and w.shape[-1] % 32 == 0 and any(
        part in name for part in ("experts", "shared_expert.", "q_proj.w")):
      data = gguf.quants.quantize(np.ascontiguousarray(stored),
                                  gguf.GGMLQuantizationType.Q8_0)
      writer.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
      w = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
      if arch == "mixtral" and ".q_proj." in name:
        w = gguf_lib.unpermute_qk(w, c.num_heads)
    else:
      writer.add_tensor(gname, np.ascontiguousarray(stored))
    held[name] = np.asarray(w, np.float32)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return held


def _refit(torch_model, held):
  """A copy of `torch_model` holding `held` (fused experts again)."""
  import copy  # pylint: disable=g-import-not-at-top
  state = {}
  for name, w in held.items():
    if name.endswith("experts.gate_proj"):
      stem = name[:-len("gate_proj")]
      w = np.concatenate([w, held[stem + "up_proj"]], 1)
      name = stem + "gate_up_proj"
    elif name.endswith("experts.up_proj"):
      continue
    state[name] = torch.from_numpy(w)
  refit = copy.deepcopy(torch_model)
  refit.load_state_dict(state)
  return refit


@pytest.mark.parametrize("arch", list(_GGUF_ARCHS))
def test_gguf_experts_match_transformers(checkpoint, arch, tmp_path):
  model, torch_model = checkpoint(arch)
  path = tmp_path / f"{arch}.gguf"
  _write_moe_gguf(path, arch, model, torch_model)
  loaded = gguf_lib.load_gguf(path, progress=False).with_plan(model.plan)
  # The file holds eps in float32, as the activations use it: the same
  # model, whose program is then the cached one.
  eps = np.float32(model.config.rms_norm_eps)
  assert loaded.config == model.config.replace(rms_norm_eps=float(eps))
  loaded = loaded.replace(config=model.config)
  tokens = np.random.default_rng(1).integers(0, 128, (B, 6))
  logits, _ = _step(loaded, jnp.asarray(tokens), loaded.init_cache(B, S))
  np.testing.assert_allclose(logits, _hf_logits(torch_model, tokens),
                             atol=ATOL)
  if kernels.available():  # `auto` times dense layers: it keeps floats
    choice = registry.auto_quantize(path, cache_dir=tmp_path,
                                    progress=False)
    assert (choice.source, choice.quantize) == ("fixed", None)
    assert "mixture of experts" in choice.why


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(_GGUF_ARCHS))
def test_gguf_q8_0_experts_match_transformers(checkpoint, arch, tmp_path):
  """Q8_0 experts, shared expert and q rows, loaded dequantised and with
  `quantize="gguf"` (the experts kept as stacked blocks), against
  transformers holding the same dequantised values, per layer and in the
  kernel plan."""
  model, torch_model = checkpoint(arch)
  path = tmp_path / f"{arch}.gguf"
  held = _write_moe_gguf(path, arch, model, torch_model, quantized=True)
  tokens = np.random.default_rng(1).integers(0, 128, (B, 6))
  want = _hf_logits(_refit(torch_model, held), tokens)
  assert np.abs(want - _hf_logits(torch_model, tokens)).max() > 1e-4
  plans = ["in_out/xla"] + (["out_in/kernel"] if kernels.available()
                            else [])
  for quantize, plan in [(None, "in_out/xla")] + [("gguf", p) for p in plans]:
    loaded = gguf_lib.load_gguf(path, progress=False, quantize=quantize)
    loaded = loaded.with_plan(cpu.plan(plan))
    assert loaded.quantization == (None if quantize is None else "q8_0")
    assert models.is_quantized(
        loaded.params["layers_0"]["experts_down"]) == (quantize == "gguf")
    logits, _ = _step(loaded, jnp.asarray(tokens), loaded.init_cache(B, S))
    np.testing.assert_allclose(logits, want, atol=ATOL)


@pytest.mark.parametrize("key, value, missing", [
    ("expert_gating_func", 2, "sigmoid"),
    ("expert_weights_scale", 2.5, "scaled or grouped"),
    ("expert_group_count", 4, "scaled or grouped")])
def test_gguf_routing_specjax_does_not_run_is_named(tmp_path, key, value,
                                                    missing):
  import gguf  # pylint: disable=g-import-not-at-top
  path = tmp_path / "routing.gguf"
  writer = gguf.GGUFWriter(str(path), "qwen3moe")
  for name, v in (("block_count", 1), ("embedding_length", 64),
                  ("feed_forward_length", 32), ("attention.head_count", 4),
                  ("expert_count", 8), ("expert_used_count", 2)):
    writer.add_uint32(f"qwen3moe.{name}", v)
  writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-5)
  add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
  add(f"qwen3moe.{key}", value)
  writer.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match=missing):
    gguf_lib.load_gguf(path, progress=False)


def test_incomplete_experts_are_named(checkpoint, tmp_path):
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  model, torch_model = checkpoint("mixtral")
  del model
  torch_model.save_pretrained(tmp_path)
  path = os.path.join(tmp_path, "model.safetensors")
  tensors = load_file(path)
  del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
  save_file(tensors, path)
  with pytest.raises(ValueError, match=r"layers\.1.*experts \[3\] missing"):
    hf.load_hf(tmp_path)


# The enumeration test (test_distribution.py's): 20 000 sampled
# generations of 3 tokens against the target's exact joint law.
@pytest.mark.slow
@pytest.mark.parametrize("draft_kind", ["dense", "moe", "self"])
def test_sampling_matches_exact_distribution(draft_kind):
  small = dict(vocab_size=dist.VOCAB)
  target = _moe_model(TINY_MOE.replace(**small), 4,
                      expert_scale=4.0 if draft_kind == "self" else 1.0)
  target = target.replace(params=dict(
      target.params, lm_head=target.params["lm_head"] * 10.0))
  if draft_kind == "dense":
    draft = dist._peaked(testing.TINY_DRAFT, 5)
  elif draft_kind == "self":  # the target routing to its top expert
    draft = moe.fewer_experts(target, 1)
  else:
    draft = _moe_model(TINY_MOE.replace(
        num_layers=1, num_experts=4, num_experts_per_tok=1, **small), 5)
  settings = (1.0, 0, 1.0)
  joint = dist._exact_joint(target, settings)
  samples = dist._spec_samples((target, draft), 2, settings, seed=7)
  stat, critical = dist._chi_square(samples, joint)
  assert stat < critical, (stat, critical)
