"""Traced settings never recompile the generation."""

from specjax import decode
from specjax import testing

PROMPTS = [[1, 2, 3], [4, 5]]


def test_speculative_settings_do_not_recompile():
  target, draft = testing.tiny_pair(seed=4)
  run = lambda **kw: decode.speculative_generate(
      target, draft, PROMPTS, gamma=2, max_new_tokens=6, **kw)
  run()
  compiled = decode._speculative_generate._cache_size()
  run(temperature=0.8)
  run(temperature=1.3, top_p=0.9, key=123)
  run(temperature=0.5, top_k=5, key=7, draft_stop_threshold=0.3)
  run(eos_id=17)
  assert decode._speculative_generate._cache_size() == compiled
  decode.speculative_generate(target, draft, PROMPTS, gamma=3,
                              max_new_tokens=6)
  # A new gamma fixes a new shape: exactly one more compilation.
  assert decode._speculative_generate._cache_size() == compiled + 1


def test_autoregressive_settings_do_not_recompile():
  target, _ = testing.tiny_pair(seed=4)
  run = lambda **kw: decode.generate(target, PROMPTS, max_new_tokens=6, **kw)
  run()
  compiled = decode._generate._cache_size()
  run(temperature=0.9, top_k=3, top_p=0.5, key=99, eos_id=3)
  assert decode._generate._cache_size() == compiled
