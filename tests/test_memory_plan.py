"""The memory plan against what XLA allocates for the same call.

`memory.plan` counts weights, caches, logits and the widest pass's
activations from shapes; XLA's `memory_analysis()` of the compiled call
(exact on CPU) splits what the executable holds into argument, output,
temporary and aliased bytes. The comparable figure is argument + output +
temp - alias: arguments (weights, prompts) and outputs live for the whole
call, the temporaries are one block sized to the heap simulator's peak
(caches and activations), and an aliased output reuses an argument's
buffer. The calls are compiled, never run: the tiny pair at vocabulary 8
with one 5-token prompt repeated B times, N = 2, γ = 3
(`scripts/bench_batch_memory.py`), and the real Qwen pair.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from specjax import compilation
from specjax import decode
from specjax import loops
from specjax import models
from specjax import testing
from specjax.decoder import SpeculativeDecoder
from specjax.models import moe
from specjax.sharding import memory

GAMMA = 3
PROMPT = [1, 2, 3, 4, 5]
TOLERANCE = 0.2
REAL_TARGET, REAL_DRAFT = ("qwen2.5-coder-1.5b-instruct",
                           "qwen2.5-coder-0.5b-instruct")


def planned_and_compiled(target, draft, prompt, batch: int
                         ) -> tuple[int, int]:
  """(planned, compiled) bytes of `speculative_generate(target, draft,
  [prompt] * batch, gamma=3, max_new_tokens=2)`: the plan the call checks,
  and argument + output + temp - alias of the program it compiles."""
  decoder = SpeculativeDecoder(target, drafter=draft, gamma=GAMMA,
                               eos_id=())
  call = decoder.prepare([prompt] * batch, max_new_tokens=2, key=0)
  planned = memory.plan(
      {"target": call.target, "draft": draft}, batch=batch,
      cache_size=call.cache_size, chunk=GAMMA + 1,
      prompt_width=call.tokens.shape[1], limit=None)
  compiled = loops.speculative_loop.lower(
      call.target, call.drafter, call.tokens, call.lengths, call.params,
      call.key, call.budget, call.policy, None, tokens_cap=call.tokens_cap,
      cache_size=call.cache_size, pad_id=0, num_nodes=None).compile()
  m = compiled.memory_analysis()
  return planned.per_device, (
      m.argument_size_in_bytes + m.output_size_in_bytes
      + m.temp_size_in_bytes - m.alias_size_in_bytes)


@pytest.fixture(scope="module")
def tiny():
  return testing.tiny_pair(vocab_size=8)


# B <= 64 (S = 256) runs a chunked prefill, whose attention scores
# dominate; B >= 1024 (S = 16) one pass over the prompt buffer, whose MLP
# dominates. The S = 256 programs take seconds longer to compile.
@pytest.mark.parametrize("batch", [
    pytest.param(1, marks=pytest.mark.slow),
    pytest.param(64, marks=pytest.mark.slow),
    pytest.param(1024, marks=pytest.mark.slow), 24000])
def test_plan_is_within_20_percent_of_the_compiled_call(tiny, batch):
  planned, compiled = planned_and_compiled(*tiny, PROMPT, batch)
  assert abs(planned / compiled - 1) < TOLERANCE, (planned, compiled)


def test_prefill_pass_follows_the_prompt_buffer():
  assert memory.prefill_pass(256, 256) == (64, 320)  # chunks read the cache
  assert memory.prefill_pass(16, 16) == (16, 16)  # one pass, no cache
  assert memory.prefill_pass(100, 100) == (100, 100)  # not a multiple


def test_call_that_cannot_fit_fails_before_compiling_naming_the_largest(
    tiny, monkeypatch):
  """At B = 24000 the prefill's MLP arrays outweigh the caches: the error
  names them and the bytes, and nothing compiles."""
  monkeypatch.setattr(memory, "device_memory", lambda: 512 << 20)
  before = compilation.num_compiled()
  with pytest.raises(MemoryError) as error:
    decode.speculative_generate(*tiny, [PROMPT] * 24000, gamma=GAMMA,
                                max_new_tokens=2)
  assert compilation.num_compiled() == before
  message = str(error.value)
  plan = memory.plan(dict(zip(("target", "draft"), tiny)), batch=24000,
                     cache_size=16, chunk=GAMMA + 1, limit=512 << 20)
  assert plan.largest.kind == "activations"
  for piece in (f"needs {plan.per_device} bytes", "has 536870912 bytes",
                "largest buffer is the target activations, 937.50 MiB",
                "prefill: 4 x [B, T, F] = 4 x [24000, 16, 128] float32",
                "target cache 187.59 MiB"):
    assert piece in message, (piece, message)


@pytest.fixture(scope="module")
def real_pair():
  from specjax import registry  # pylint: disable=g-import-not-at-top
  target, tokenizer = registry.load_pretrained(REAL_TARGET, jnp.float32)
  draft, _ = registry.load_pretrained(REAL_DRAFT, jnp.float32)
  return target, draft, tokenizer.encode("def fibonacci(n: int) -> int:\n")


@pytest.mark.real_models
@pytest.mark.parametrize("batch", [1, 16])
def test_plan_is_within_20_percent_on_the_real_pair(real_pair, batch):
  target, draft, prompt = real_pair
  planned, compiled = planned_and_compiled(target, draft, prompt, batch)
  assert abs(planned / compiled - 1) < TOLERANCE, (planned, compiled)


def test_a_self_draft_sharing_the_targets_arrays_is_held_once():
  """The fewer-experts self-draft is the target's own arrays: the plan
  counts them once (its cache and logits still count)."""
  target = models.init_random(models.ModelConfig(
      arch="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32,
      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
      num_experts_per_tok=2), jax.random.key(0))
  draft = moe.fewer_experts(target, 1)
  kw = dict(batch=1, cache_size=64, chunk=4, limit=None)
  both = memory.plan({"target": target, "draft": draft}, **kw)
  alone = memory.plan({"target": target}, **kw)
  assert both.bytes("draft", "weights") == 0
  assert both.bytes("target", "weights") == alone.bytes("target", "weights")
  assert both.bytes("draft", "cache") == alone.bytes("target", "cache") > 0
  # A second model of its own arrays counts them.
  other = memory.plan({"target": target, "draft": models.init_random(
      target.config, jax.random.key(1))}, **kw)
  assert other.bytes("draft", "weights") == alone.bytes("target", "weights")
