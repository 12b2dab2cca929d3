"""Medusa heads: exact drafting, and training that learns, resumes and
restores (`specjax.heads`).

Greedy outputs are checked against autoregressive decoding of the target;
the exact distribution by enumeration in `tests/test_distribution.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode
from specjax import models
from specjax import testing
from specjax.heads import data
from specjax.heads import Medusa
from specjax.heads import train

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 24
CONFIG = train.TrainConfig(num_heads=3, batch_size=8, num_steps=40,
                           learning_rate=3e-3, warmup_steps=4, eval_every=20,
                           save_every=10, keep=2)


@pytest.fixture(scope="module")
def target():
  # Peaked logits, so the target's distributions carry something to learn.
  model = testing.tiny_pair(seed=0)[0]
  return model.replace(params=dict(model.params,
                                   lm_head=model.params["lm_head"] * 8.0))


@pytest.fixture(scope="module")
def features(target):
  # A corpus with structure: a repeating sequence, read at many offsets.
  text = np.tile(np.arange(40) * 3 % 128, 100)
  tokens = np.stack([text[i * 7:i * 7 + 32] for i in range(48)])
  return data.extract(target, tokens.astype(np.int32), batch=8)


@pytest.mark.parametrize("gamma, num_heads", [(3, 3), (4, 2), (2, 3)])
def test_greedy_equals_autoregressive(target, gamma, num_heads):
  baseline = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  out = decode.speculative_generate(target, testing.random_medusa(target, num_heads),
                                    PROMPTS, gamma=gamma,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  proposed = out.stats.proposed_by_position
  assert np.all(proposed[:min(gamma, num_heads)] > 0)
  assert np.all(proposed[num_heads:] == 0)  # no head past the K-th


def test_training_lowers_the_loss_and_raises_accuracy(target, features,
                                                      tmp_path):
  params, history = train.fit(target, features[:40], features[40:], CONFIG,
                              tmp_path)
  first, last = history[0], history[-1]
  assert last["step"] == CONFIG.num_steps
  assert np.mean(last["val_loss"]) < 0.8 * np.mean(first["val_loss"])
  # Heads start as the identity (they predict the next token, not the one
  # after it); training must move head 1 to its own target.
  assert first["step"] == 0
  assert last["val_accuracy"][0] > first["val_accuracy"][0] + 0.2
  assert params["w"].shape == (1, 3, 64, 64)
  train.save_plot(history, tmp_path / "plot.png")
  assert (tmp_path / "plot.png").stat().st_size > 1000


def test_resumed_training_equals_uninterrupted(target, features, tmp_path):
  whole, _ = train.fit(target, features[:40], features[40:], CONFIG,
                       tmp_path / "whole")
  train.fit(target, features[:40], features[40:], CONFIG, tmp_path / "cut",
            stop_at=25)
  steps = sorted(int(p.name) for p in (tmp_path / "cut/checkpoints").iterdir()
                 if p.name.isdigit())
  assert steps == [20, 25]  # keep=2: the last two
  resumed, history = train.fit(target, features[:40], features[40:], CONFIG,
                               tmp_path / "cut")
  assert history[-1]["step"] == CONFIG.num_steps
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)


def test_restored_heads_propose_as_in_memory(target, features, tmp_path):
  params, _ = train.fit(target, features[:40], features[40:],
                        CONFIG, tmp_path)
  restored = train.load_medusa(tmp_path, target)
  in_memory = Medusa(target=target, params=params, num_heads=3)
  runs = [decode.speculative_generate(target, m, PROMPTS, gamma=3,
                                      max_new_tokens=MAX_NEW,
                                      temperature=1.0, key=5)
          for m in (restored, in_memory)]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  np.testing.assert_array_equal(runs[0].stats.accepted,
                                runs[1].stats.accepted)


def test_load_errors_name_the_problem(target, features, tmp_path):
  train.fit(target, features[:40], features[40:],
            train.TrainConfig(num_steps=2, batch_size=8, eval_every=2,
                              save_every=2), tmp_path / "ok")
  other = models.init_random(testing.TINY_DRAFT, jax.random.key(0))
  with pytest.raises(train.CheckpointError,
                     match="hidden size 64 and vocabulary 128.*this target "
                     "has hidden size 32 and vocabulary 128"):
    train.load_medusa(tmp_path / "ok", other)
  with pytest.raises(train.CheckpointError, match="No heads checkpoint"):
    train.load_medusa(tmp_path / "missing", target)
  # A partial checkpoint: the state's array files are gone.
  step = tmp_path / "ok/checkpoints/2/state"
  for f in sorted(step.rglob("*")):
    if f.is_file() and "meta" not in f.name:
      f.write_bytes(b"\0garbage")
  with pytest.raises(train.CheckpointError, match="corrupt or partial"):
    train.load_medusa(tmp_path / "ok", target)
