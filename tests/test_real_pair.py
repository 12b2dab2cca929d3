"""The real pair: the 1.5B target's logits and greedy output equal
transformers', and 0.5B -> 1.5B speculative output equals `generate`.

Marked `real_models`. transformers computes every reference result on the
1.5B GGUF file first (`reference`) and is freed before specjax's copy
loads (`target`); see `tests/real_reference.py`.
"""

import gc

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import metrics
from specjax import registry
from tests import real_reference

pytestmark = pytest.mark.real_models

GREEDY_PROMPTS = [
    "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci "
    "number.\"\"\"\n",
    "# Read a CSV file and print the average of the 'price' column\n"
    "import csv\n\n",
]
GREEDY_TOKENS = 32
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def reference() -> dict:
  return real_reference.transformers_results(TARGET, GREEDY_PROMPTS,
                                             GREEDY_TOKENS)


@pytest.fixture(scope="module")
def target(reference):  # after transformers' copy is freed
  del reference
  yield registry.load_pretrained(TARGET, jnp.float32)[0]
  gc.collect()


def test_target_logits_match_transformers(reference, target):
  real_reference.check_logits(TARGET, reference, target)


def test_greedy_and_speculative_match_transformers_on_the_real_pair(
    reference, target):
  """1.5B greedy equals transformers' greedy; 0.5B->1.5B speculative equals
  greedy `generate` token for token."""
  from specjax import decode  # pylint: disable=g-import-not-at-top
  tokenizer = registry.load_tokenizer(TARGET)
  draft, _ = registry.load_pretrained(DRAFT, jnp.float32)
  prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
  greedy = decode.generate(target, prompts, max_new_tokens=GREEDY_TOKENS)
  spec = decode.speculative_generate(target, draft, prompts, gamma=4,
                                     max_new_tokens=GREEDY_TOKENS)
  np.testing.assert_array_equal(spec.tokens, greedy.tokens)
  np.testing.assert_array_equal(spec.lengths, greedy.lengths)
  del draft, spec
  gc.collect()

  for b, (prompt, want) in enumerate(zip(prompts, reference["greedy"])):
    got = greedy.row(b)
    i = metrics.first_difference(got, want)
    if i is None:
      assert got == want
      print(f"prompt {b}: {len(got)} tokens equal to transformers'")
      continue
    # A disagreement is only acceptable at a numerical near-tie: the top-2
    # logits at the first differing position (specjax's logits, same prefix)
    # must be within 1e-3 relative of each other.
    seq = jnp.asarray([prompt + got[:i]], jnp.int32)
    out, _ = target(seq, target.init_cache(1, seq.shape[1]))
    top2 = np.sort(np.asarray(out.logits[0, -1]))[-2:]
    gap = float(top2[1] - top2[0])
    print(f"prompt {b}: first difference at token {i}, top-2 gap {gap:.2e}")
    assert gap <= 1e-3 * abs(top2[1]), (b, i, gap)
