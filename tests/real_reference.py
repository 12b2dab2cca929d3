"""transformers' results on the real offline GGUF models, and the logits check.

Shared by `test_real_models.py` (the small models) and `test_real_pair.py`
(the pair's target), two files so that `pytest -n 2 --dist loadfile` runs
them on two workers. transformers loads the same GGUF file as specjax, in
fp32, through `from_pretrained(dir, gguf_file=...)` (about 110 s for the
1.5B on a 2-core EPYC: its GGUF reader and dequantisation are Python), once
per model, and is freed before specjax's copy loads (one fp32 copy of the
1.5B is 7.1 GB).

Shape letters: T tokens, V vocab.
"""

import gc
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import registry
from specjax import weights

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


def transformers_results(name: str, greedy_prompts: Sequence[str] = (),
                         greedy_tokens: int = 0) -> dict:
  """transformers' fp32 results on `name`'s GGUF file (one load).

  Returns:
    {'ids': the [T] ids of `CODE_PROMPT`'s first `NUM_TOKENS` tokens,
     'logits': [T, V] float32 over them, 'greedy': one list of
     `greedy_tokens` greedy ids per entry of `greedy_prompts`}. The model is
    freed before returning.
  """
  # pylint: disable=g-import-not-at-top
  import torch
  from transformers import AutoModelForCausalLM

  tokenizer = registry.load_tokenizer(name)
  ids = tokenizer.encode(CODE_PROMPT)[:NUM_TOKENS]
  torch.set_num_threads(2)
  path = weights.fetch(name)
  reference = AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  out = {"ids": ids, "greedy": []}
  with torch.no_grad():
    out["logits"] = reference(torch.tensor([ids])).logits[0].float().numpy()
    for prompt in map(tokenizer.encode, greedy_prompts):
      continued = reference.generate(
          torch.tensor([prompt]), max_new_tokens=greedy_tokens,
          do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                     dtype=torch.long),
          pad_token_id=tokenizer.pad_id or 0, eos_token_id=None)
      out["greedy"].append(continued[0, len(prompt):].tolist())
  del reference
  gc.collect()
  return out


def check_logits(name: str, reference: dict, model) -> None:
  """specjax `model`'s fp32 logits over `reference['ids']` equal
  transformers' to `MAX_REL_ERR` of their scale, argmax nearly everywhere."""
  ids, want = reference["ids"], reference["logits"]
  assert len(ids) == NUM_TOKENS
  assert model.dtype == jnp.float32
  forward = jax.jit(lambda m, t, c: m(t, c)[0].logits)
  got = np.asarray(forward(model, jnp.asarray([ids], jnp.int32),
                           model.init_cache(1, NUM_TOKENS))[0])

  assert got.shape == want.shape == (NUM_TOKENS, model.vocab_size)
  rel_err = np.abs(got - want).max() / np.abs(want).max()
  print(f"{name}: max|a-b|/max|b| = {rel_err:.2e}")
  assert rel_err <= MAX_REL_ERR
  # Same greedy next token nearly everywhere (ties aside).
  assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
