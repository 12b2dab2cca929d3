"""Traced settings never recompile the generation."""

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance
from specjax import policies
from specjax import compilation
from specjax import decode
from specjax import loops
from specjax import padding
from specjax import drafters
from specjax import testing

PROMPTS = [[1, 2, 3], [4, 5]]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_speculative_settings_do_not_recompile():
  target, draft = testing.tiny_pair(seed=4)
  run = lambda **kw: decode.speculative_generate(
      target, draft, PROMPTS, gamma=2, max_new_tokens=6, **kw)
  run()
  compiled = loops.speculative_loop._cache_size()
  run(temperature=0.8)
  run(temperature=1.3, top_p=0.9, key=123)
  run(temperature=0.5, top_k=5, key=7, draft_stop_threshold=0.3)
  run(eos_id=17)
  assert loops.speculative_loop._cache_size() == compiled
  decode.speculative_generate(target, draft, PROMPTS, gamma=3,
                              max_new_tokens=6)
  # A new gamma fixes a new shape: exactly one more compilation.
  assert loops.speculative_loop._cache_size() == compiled + 1


def test_autoregressive_settings_do_not_recompile():
  target, _ = testing.tiny_pair(seed=4)
  run = lambda **kw: decode.generate(target, PROMPTS, max_new_tokens=6, **kw)
  run()
  compiled = loops.generate_loop._cache_size()
  run(temperature=0.9, top_k=3, top_p=0.5, key=99, eos_id=3)
  assert loops.generate_loop._cache_size() == compiled


_LOWERED = {"count": 0}


def _count_lowering(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  # Every program a backend compiles (or reads from the persistent cache)
  # is lowered first: jitted loops and the helper programs eager
  # operations compile (`jnp.asarray` of a new shape, `jax.random.key`).
  if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
    _LOWERED["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_lowering)

# The call mix of issue 54: one prompt a call, 5 to 600 tokens, N in
# {16, 48, 100}.
_MIX_LENGTHS = (5, 17, 40, 64, 65, 130, 200, 300, 450, 600)
_MIX_TOKENS = (16, 48, 100)


def _programs_for_mix(run) -> int:
  """Programs lowered while `run(prompt, max_new_tokens)` serves the mix."""
  before = _LOWERED["count"]
  for i, n in enumerate(_MIX_LENGTHS):
    prompt = [(11 * j + i) % 120 + 1 for j in range(n)]
    for new in _MIX_TOKENS:
      out = run(prompt, new)
      assert out.tokens.shape == (1, new) and out.lengths[0] == new
  return _LOWERED["count"] - before


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_call_mix_compiles_at_most_four_programs_per_api():
  # Each cache class (256, 512, 1024 positions here) is one program; the
  # prompt's length and N are traced, and no call compiles a helper. The
  # count includes every program lowered in this process, so a helper
  # (e.g. `jnp.asarray` staging a [1, P] prompt per shape) counts too.
  target, draft = testing.tiny_pair(seed=5)
  generated = _programs_for_mix(lambda prompt, new: decode.generate(
      target, [prompt], max_new_tokens=new))
  assert generated <= 4, generated
  speculated = _programs_for_mix(
      lambda prompt, new: decode.speculative_generate(
          target, draft, [prompt], gamma=4, max_new_tokens=new))
  assert speculated <= 4, speculated


def test_a_large_batch_gets_the_cache_its_call_needs():
  # Up to 64 rows the class floor is 256 positions; past it, B * S stays
  # under 64 * 256 down to what the call needs.
  assert [padding.cache_class(9, b) for b in (1, 64, 65, 1000, 24000)] == [
      256, 256, 128, 16, 16]
  assert padding.cache_class(300, 24000) == 512


@pytest.mark.slow  # two speculative programs at B = 200; the slow step
def test_a_large_batch_decodes_as_in_a_full_cache():
  # The tokens are those of the same call in a 256-position cache.
  target, draft = testing.tiny_pair(seed=5)
  prompts = [[1, 2, 3, 4, 5], [7, 8]] * 100  # B = 200: S = 64
  kw = dict(gamma=3, max_new_tokens=6, temperature=1.0, key=2)
  small = decode.speculative_generate(target, draft, prompts, **kw)
  full = decode.speculative_generate(target, draft, prompts,
                                     cache_size=256, **kw)
  assert small.tokens.shape[1] == 6
  np.testing.assert_array_equal(small.tokens, full.tokens)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_warmup_compiles_what_a_later_call_uses():
  # B = 3: no other test here compiles for it, so the programs are new.
  target, draft = testing.tiny_pair(seed=6)
  compiled = decode.warmup(target, draft, batch=3, prompt_len=40,
                           max_new_tokens=20, gamma=3)
  assert compiled == 2  # one autoregressive, one speculative program
  before = compilation.num_compiled()
  prompts = [list(range(1, 38)), [5, 6], list(range(9, 20))]
  decode.generate(target, prompts, max_new_tokens=20)
  decode.speculative_generate(target, draft, prompts, gamma=3,
                              max_new_tokens=11)
  assert compilation.num_compiled() == before
  # N = 100 still fits the same cache class (256 positions): nothing new.
  assert decode.warmup(target, batch=3, prompt_len=40,
                       max_new_tokens=100) == 0
  # Past it, the warmed-up program is the next class's.
  assert decode.warmup(target, batch=3, prompt_len=40,
                       max_new_tokens=300) == 1
  before = compilation.num_compiled()
  decode.generate(target, prompts, max_new_tokens=90)
  decode.generate(target, prompts, max_new_tokens=290)
  assert compilation.num_compiled() == before


def _loop_copies(hlo: str, config, batch: int, size: int) -> int:
  """Copies, outside the entry computation (in loop bodies and branches),
  of an array shaped like `config`'s cache k or v [L, B, S, K, D]."""
  shape = re.escape(f"f32[{config.num_layers},{batch},{size},"
                    f"{config.num_kv_heads},{config.head_dim}]")
  count, entry = 0, False
  for line in hlo.splitlines():
    if line and not line.startswith(" "):
      entry = line.startswith("ENTRY")
    elif not entry and re.search(shape + r"\{[^}]*\} copy\(", line):
      count += 1
  return count


_LOOP = dict(batch=3, size=64, gamma=4)


def _speculative_hlo(target, drafter, policy, synthetic: bool) -> str:
  params = decode.StepParams.create(
      acceptance=acceptance.Synthetic.create(0.5) if synthetic
      else acceptance.Exact())
  """The optimized HLO of `_speculative_generate` at `_LOOP`'s shapes,
  greedy, 16 new tokens from 8-token prompts."""
  batch, size, gamma = _LOOP["batch"], _LOOP["size"], _LOOP["gamma"]
  return loops.speculative_loop.lower(
      target, drafter, jnp.ones((batch, 8), jnp.int32),
      jnp.full((batch,), 8, jnp.int32), params, jax.random.key(0),
      jnp.int32(16), policies.Fixed(gamma) if policy is None else policy,
      tokens_cap=16, cache_size=size,
      pad_id=0, num_nodes=None).compile().as_text()


def _auto() -> policies.Auto:
  return policies.Auto.create(max_gamma=_LOOP["gamma"],
                              target_ms=[1.0, 1.1, 1.2, 1.5], draft_ms=0.2)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
@pytest.mark.parametrize("policy,synthetic", [
    (None, False), ("auto", False),
    pytest.param("auto", True, marks=pytest.mark.extended)])
def test_decoding_loops_update_caches_in_place(policy, synthetic):
  # Every forward reads the old cache, then writes the chunk's keys and
  # values into it. Unless the write is ordered after the last read, XLA
  # keeps the old values by copying the whole cache, on every step and in
  # every drafting loop; a `lax.cond` that passes a cache through one
  # branch copies it too. No compiled loop may copy either model's cache.
  target, draft = testing.tiny_pair(seed=4)
  batch, size = _LOOP["batch"], _LOOP["size"]
  if policy is None:
    hlo = loops.generate_loop.lower(
        target, jnp.ones((batch, 8), jnp.int32),
        jnp.full((batch,), 8, jnp.int32), decode.StepParams.create().sampling,
        jnp.array([-1]),
        jax.random.key(0), jnp.int32(16), tokens_cap=16, cache_size=size,
        pad_id=0).compile().as_text()
    assert _loop_copies(hlo, testing.TINY_TARGET, batch, size) == 0
  hlo = _speculative_hlo(target, drafters.DraftModel(draft),
                         None if policy is None else _auto(), synthetic)
  assert _loop_copies(hlo, testing.TINY_TARGET, batch, size) == 0
  assert _loop_copies(hlo, testing.TINY_DRAFT, batch, size) == 0


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_eagle_updates_its_layer_cache_in_place():
  # EAGLE's one-layer cache, [1, B, S, K, D] at the target's heads, is read
  # and written by every drafted token and every commit; under an adaptive
  # policy its drafting loop and the outer loop copied it (4 copies).
  target, _ = testing.tiny_pair(seed=4)
  hlo = _speculative_hlo(target, testing.random_eagle(target), _auto(),
                         synthetic=False)
  layer = dataclasses.replace(testing.TINY_TARGET, num_layers=1)
  assert _loop_copies(hlo, layer, _LOOP["batch"], _LOOP["size"]) == 0
  assert _loop_copies(hlo, testing.TINY_TARGET, _LOOP["batch"],
                      _LOOP["size"]) == 0


_SECOND_PROCESS = """
import jax
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None)
from specjax import decode, testing
target, _ = testing.tiny_pair(seed=8)
decode.generate(target, [[1, 2, 3]], max_new_tokens=5)
print("cache_dir", jax.config.jax_compilation_cache_dir)
print("hits", len(hits))
"""


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_a_second_process_reuses_the_persistent_cache(tmp_path):
  env = dict(os.environ, SPECJAX_CACHE=str(tmp_path),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
             PYTHONPATH=REPO)
  env.pop(compilation.OPT_OUT, None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  runs = [subprocess.run([sys.executable, "-c", _SECOND_PROCESS], env=env,
                         capture_output=True, text=True, timeout=300,
                         check=True).stdout for _ in range(2)]
  assert f"cache_dir {tmp_path / 'xla_cache'}" in runs[0]
  assert "hits 0" in runs[0]
  assert "hits 0" not in runs[1], runs[1]


def test_compiled_lists_each_program_with_its_time():
  # B = 5 and this prompt: no other test compiles this program.
  target = testing.tiny_pair(seed=7)[0]
  before = len(compilation.compiled())
  prompts = [[1, 2, 3]] * 5
  decode.generate(target, prompts, max_new_tokens=3)
  decode.generate(target, prompts, max_new_tokens=3)  # compiled already
  new = compilation.compiled()[before:]
  assert [c.name for c in new] == ["generate"], new
  assert new[0].shapes.startswith("B=5,") and new[0].seconds > 0, new
