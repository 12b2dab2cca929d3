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
  forward = jax.jit(lambda m, t, c: m(t, c)[0])
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
