"""specjax logits match transformers' on the real offline GGUF models.

Marked `real_models`. Both implementations load the same GGUF file in fp32:
transformers through `from_pretrained(dir, gguf_file=...)`, specjax through
`specjax.registry.load_pretrained` (fetch + convert on first use, restore
afterwards). One model is in memory at a time (the 1.5B model is 7.1 GB in
fp32 per copy).
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import registry
from specjax import weights

pytestmark = pytest.mark.real_models

CODE_PROMPT = '''import heapq
from typing import Dict, List, Tuple


def dijkstra(graph: Dict[str, List[Tuple[str, int]]], source: str):
    """Shortest distances from `source` to every node of `graph`."""
    dist = {node: float("inf") for node in graph}
    dist[source] = 0
    queue = [(0, source)]
    while queue:
        d, node = heapq.heappop(queue)
        if d > dist[node]:
            continue
        for neighbour, weight in graph[node]:
            new = d + weight
            if new < dist[neighbour]:
                dist[neighbour] = new
                heapq.heappush(queue, (new, neighbour))
    return dist
'''
NUM_TOKENS = 64
MAX_REL_ERR = 1e-3


@pytest.mark.parametrize("name", ["smollm2-135m-instruct",
                                  "qwen2.5-coder-0.5b-instruct",
                                  "qwen2.5-coder-1.5b-instruct"])
def test_logits_match_transformers(name):
  # pylint: disable=g-import-not-at-top
  import torch
  from transformers import AutoModelForCausalLM

  path = weights.fetch(name)
  tokenizer = registry.load_tokenizer(name)
  ids = tokenizer.encode(CODE_PROMPT)[:NUM_TOKENS]
  assert len(ids) == NUM_TOKENS

  # Reference first, then freed, so only one copy of the weights is alive.
  torch.set_num_threads(2)
  reference = AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  with torch.no_grad():
    want = reference(torch.tensor([ids])).logits[0].float().numpy()
  del reference
  gc.collect()

  model, _ = registry.load_pretrained(name, jnp.float32)
  assert model.dtype == jnp.float32
  forward = jax.jit(lambda m, t, c: m(t, c)[0].logits)
  got = np.asarray(forward(model, jnp.asarray([ids], jnp.int32),
                           model.init_cache(1, NUM_TOKENS))[0])
  del model
  gc.collect()

  assert got.shape == want.shape == (NUM_TOKENS, tokenizer.vocab_size)
  rel_err = np.abs(got - want).max() / np.abs(want).max()
  print(f"{name}: max|a-b|/max|b| = {rel_err:.2e}")
  assert rel_err <= MAX_REL_ERR
  # Same greedy next token nearly everywhere (ties aside).
  assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


GREEDY_PROMPTS = [
    "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci "
    "number.\"\"\"\n",
    "# Read a CSV file and print the average of the 'price' column\n"
    "import csv\n\n",
]
GREEDY_TOKENS = 32


def _first_difference(a, b):
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None


def test_greedy_and_speculative_match_transformers_on_the_real_pair():
  """1.5B greedy equals transformers' greedy; 0.5B->1.5B speculative equals
  greedy `generate` token for token."""
  # pylint: disable=g-import-not-at-top
  import torch
  from transformers import AutoModelForCausalLM

  name = "qwen2.5-coder-1.5b-instruct"
  target, tokenizer = registry.load_pretrained(name, jnp.float32)
  draft, _ = registry.load_pretrained("qwen2.5-coder-0.5b-instruct",
                                      jnp.float32)
  prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
  from specjax import decode  # pylint: disable=g-import-not-at-top
  greedy = decode.generate(target, prompts, max_new_tokens=GREEDY_TOKENS)
  spec = decode.speculative_generate(target, draft, prompts, gamma=4,
                                     max_new_tokens=GREEDY_TOKENS)
  np.testing.assert_array_equal(spec.tokens, greedy.tokens)
  np.testing.assert_array_equal(spec.lengths, greedy.lengths)
  # Logits along specjax's own greedy path, to judge any disagreement.
  rows = [p + greedy.row(b) for b, p in enumerate(prompts)]
  del draft, spec
  gc.collect()

  torch.set_num_threads(2)
  path = weights.fetch(name)
  reference = AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  for b, prompt in enumerate(prompts):
    with torch.no_grad():
      out = reference.generate(
          torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS,
          do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                     dtype=torch.long),
          pad_token_id=tokenizer.pad_id or 0, eos_token_id=None)
    want = out[0, len(prompt):].tolist()
    got = greedy.row(b)
    i = _first_difference(got, want)
    if i is None:
      assert got == want
      print(f"prompt {b}: {len(got)} tokens equal to transformers'")
      continue
    # A disagreement is only acceptable at a numerical near-tie: the top-2
    # logits at the first differing position (specjax's logits, same prefix)
    # must be within 1e-3 relative of each other.
    seq = jnp.asarray([rows[b][:len(prompt) + i]], jnp.int32)
    out, _ = target(seq, target.init_cache(1, seq.shape[1]))
    top2 = np.sort(np.asarray(out.logits[0, -1]))[-2:]
    gap = float(top2[1] - top2[0])
    print(f"prompt {b}: first difference at token {i}, top-2 gap {gap:.2e}")
    assert gap <= 1e-3 * abs(top2[1]), (b, i, gap)
