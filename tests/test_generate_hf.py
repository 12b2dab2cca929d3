"""Greedy `generate` equals transformers' `generate(do_sample=False)`.

Each tiny random checkpoint (tests/conftest.py) is loaded by specjax with
`load_hf`; one batch mixes prompts of different lengths. transformers runs each
prompt on its own (no padding), so it is an independent reference.
"""

import numpy as np
import pytest
import torch

from specjax import decode
from specjax.checkpoints import load_hf

PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 97], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_NEW = 12


def _hf_greedy(model, prompt, eos_id):
  with torch.no_grad():
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                          dtype=torch.long),
        max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos_id,
        pad_token_id=0 if eos_id is None else eos_id)
  new = out[0, len(prompt):].tolist()
  if eos_id is not None and eos_id in new:
    new = new[:new.index(eos_id) + 1]
  return new


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma3"])
def test_greedy_generate_matches_transformers(hf_checkpoint, arch):
  directory, hf_model = hf_checkpoint(arch)
  model = load_hf(directory)
  want = [_hf_greedy(hf_model, p, None) for p in PROMPTS]
  got = decode.generate(model, PROMPTS, max_new_tokens=MAX_NEW)
  assert [got.row(b) for b in range(len(PROMPTS))] == want

  # With an EOS id that one row emits mid-way: that row stops, others go on.
  eos = want[0][4]
  want_eos = [_hf_greedy(hf_model, p, eos) for p in PROMPTS]
  assert len(want_eos[0]) < MAX_NEW
  got = decode.generate(model, PROMPTS, max_new_tokens=MAX_NEW, eos_id=eos)
  assert [got.row(b) for b in range(len(PROMPTS))] == want_eos
  np.testing.assert_array_equal(got.lengths, [len(w) for w in want_eos])
