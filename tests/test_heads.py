"""Drafting heads on the target's features: Medusa and EAGLE drafting
exactly, and training that learns, resumes and restores (`specjax.heads`).

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
from specjax.heads import eagle as eagle_lib
from specjax.heads import Eagle
from specjax.heads import Medusa
from specjax.heads import train

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 24
CONFIG = train.TrainConfig(num_heads=3, batch_size=8, num_steps=40,
                           learning_rate=3e-3, warmup_steps=4, eval_every=20,
                           save_every=10, keep=2)


def _config(kind, **changes):
  return train.TrainConfig(**dict(vars(CONFIG), kind=kind, **changes))


@pytest.fixture(scope="module")
def target():
  # Peaked logits, so the target's distributions carry something to learn.
  model = testing.tiny_pair(seed=0)[0]
  return model.replace(params=dict(model.params,
                                   lm_head=model.params["lm_head"] * 8.0))


@pytest.fixture(scope="module")
def splits(target):
  # A corpus with structure: a repeating sequence, read at many offsets.
  text = np.tile(np.arange(40) * 3 % 128, 100)
  tokens = np.stack([text[i * 7:i * 7 + 32] for i in range(48)]).astype(
      np.int32)
  hidden = data.extract(target, tokens, batch=8)
  return (train.Split(tokens=tokens[:40], hidden=hidden[:40]),
          train.Split(tokens=tokens[40:], hidden=hidden[40:]))


@pytest.mark.parametrize("prompt_len", [
    pytest.param(5, marks=pytest.mark.slow), 100])
def test_prefill_returns_every_prompt_hidden_state(target, prompt_len):
  # One pass, and the chunked path (a 128-token buffer in 64-token chunks).
  tokens = jnp.asarray(np.arange(128)[None] % 97, jnp.int32)
  lengths = jnp.array([prompt_len])
  logits, _, hidden = target.prefill(tokens, lengths,
                                     target.init_cache(1, 160),
                                     return_hidden=True)
  reference = target.forward(tokens[:, :prompt_len],
                             target.init_cache(1, 160)).hidden
  np.testing.assert_allclose(hidden[:, :prompt_len], reference, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(logits, target.logits(reference[:, -1]),
                             rtol=1e-5, atol=1e-5)


# Whole generations: the default suite keeps one EAGLE case; the others,
# Medusa's included, run with the slow tests.
@pytest.mark.parametrize("kind, gamma, num_heads", [
    pytest.param("medusa", 3, 3, marks=pytest.mark.slow),
    pytest.param("medusa", 4, 2, marks=pytest.mark.slow),
    ("eagle", 3, 0), pytest.param("eagle", 5, 0, marks=pytest.mark.slow)])
def test_greedy_equals_autoregressive(target, kind, gamma, num_heads):
  drafter = (testing.random_medusa(target, num_heads) if kind == "medusa"
             else testing.random_eagle(target))
  baseline = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW)
  out = decode.speculative_generate(target, drafter, PROMPTS, gamma=gamma,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  proposed = out.stats.proposed_by_position
  depth = min(gamma, num_heads) if kind == "medusa" else gamma
  assert np.all(proposed[:depth] > 0)
  assert np.all(proposed[depth:] == 0)  # no Medusa head past the K-th


@pytest.mark.slow
@pytest.mark.parametrize("kind", train.KINDS)
def test_training_lowers_the_loss_and_raises_accuracy(target, splits, kind,
                                                      tmp_path):
  params, history = train.fit(target, *splits, _config(kind), tmp_path)
  first, last = history[0], history[-1]
  assert first["step"] == 0 and last["step"] == CONFIG.num_steps
  assert np.mean(last["val_loss"]) < 0.8 * np.mean(first["val_loss"])
  # Medusa's heads start as the identity (predicting the next token, not
  # the one after it) and EAGLE's layer at random: training must move the
  # first prediction to the target's own greedy token.
  assert last["val_accuracy"][0] > first["val_accuracy"][0] + 0.2
  train.save_plot(history, tmp_path / "plot.png")
  assert (tmp_path / "plot.png").stat().st_size > 1000


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_eagle_drafts_from_the_pairs_it_was_trained_on(target, splits):
  # Training pairs (h_i, x_{i+1}) predict h_{i+1}. After a prompt x[:L]
  # and a first token x[L], the drafter's feature must be the prediction
  # of pair L - 1 in a teacher-forced pass over x[:L+1], and its first
  # draft the LM head's argmax there.
  eagle = testing.random_eagle(target, scale=0.3)
  x = jnp.asarray(splits[1].tokens[:1, :13])  # [1, L + 1]
  length = 12
  hidden = target.forward(x, target.init_cache(1, 16)).hidden  # [1, L+1, E]
  state = eagle.init(x[:, :length], jnp.array([length]), x[:, length], 32,
                     prompt_hidden=hidden[:, :length])
  predicted, _ = eagle.step(hidden[:, :length], x[:, 1:length + 1],
                            eagle_lib.layer_cache(target.config, 1, 32))
  np.testing.assert_allclose(state.feature, predicted[:, length - 1],
                             rtol=1e-5, atol=1e-5)
  proposal, _ = eagle.propose(state, jax.random.key(0),
                              decode.StepParams.create().sampling, 1, 0.0)
  assert int(proposal.tokens[0, 0]) == int(jnp.argmax(
      target.logits(predicted[0, length - 1])))


@pytest.mark.slow
@pytest.mark.parametrize("kind", train.KINDS)
def test_resumed_training_equals_uninterrupted(target, splits, kind,
                                               tmp_path):
  config = _config(kind)
  whole, _ = train.fit(target, *splits, config, tmp_path / "whole")
  train.fit(target, *splits, config, tmp_path / "cut", stop_at=25)
  steps = sorted(int(p.name) for p in (tmp_path / "cut/checkpoints").iterdir()
                 if p.name.isdigit())
  assert steps == [20, 25]  # keep=2: the last two
  resumed, history = train.fit(target, *splits, config, tmp_path / "cut")
  assert history[-1]["step"] == CONFIG.num_steps
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)


@pytest.mark.slow
@pytest.mark.parametrize("kind", train.KINDS)
def test_restored_heads_propose_as_in_memory(target, splits, kind,
                                             tmp_path):
  params, _ = train.fit(target, *splits, _config(kind, num_steps=10),
                        tmp_path)
  restored = train.load_heads(tmp_path, target)
  in_memory = (Medusa(target=target, params=params, num_heads=3)
               if kind == "medusa" else Eagle(target=target, params=params))
  assert type(restored) is type(in_memory)
  runs = [decode.speculative_generate(target, m, PROMPTS, gamma=3,
                                      max_new_tokens=MAX_NEW,
                                      temperature=1.0, key=5)
          for m in (restored, in_memory)]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  np.testing.assert_array_equal(runs[0].stats.accepted,
                                runs[1].stats.accepted)


def test_load_errors_name_the_problem(target, splits, tmp_path):
  train.fit(target, *splits, _config("medusa", num_steps=2, eval_every=2,
                                     save_every=2), tmp_path / "ok")
  other = models.init_random(testing.TINY_DRAFT, jax.random.key(0))
  with pytest.raises(train.CheckpointError,
                     match="hidden size 64 and vocabulary 128.*this target "
                     "has hidden size 32 and vocabulary 128"):
    train.load_heads(tmp_path / "ok", other)
  with pytest.raises(train.CheckpointError, match="No heads checkpoint"):
    train.load_heads(tmp_path / "missing", target)
  # A partial checkpoint: the state's array files are overwritten.
  for f in sorted((tmp_path / "ok/checkpoints/2/state").rglob("*")):
    if f.is_file() and "meta" not in f.name:
      f.write_bytes(b"\0garbage")
  with pytest.raises(train.CheckpointError, match="corrupt or partial"):
    train.load_heads(tmp_path / "ok", target)
  with pytest.raises(ValueError, match="kind must be one of"):
    train.recipe(target, _config("hydra"))
