"""Quality of int8 / int4 weight-only quantization against float32.

A tiny byte-level model (vocabulary V = 256 bytes) is trained for a few
hundred Adam steps on the first 14 KB of Python's own `textwrap.py` (it
ships with every Python, so the test is offline), then scored on the
file's last 4 KB, which it never saw: perplexity, the fraction of
held-out positions whose greedy (argmax) prediction matches float32's, and
how many tokens free-running greedy decoding agrees with float32's before
they part.

Measured (XLA CPU, jax 0.10.2): fp32 perplexity 8.93; int8 x1.0009 of it,
99.3% of argmax predictions kept, greedy agreement 28.4 of 32 tokens;
int4 (G = 32, asymmetric) x1.014, 92.4%, 11.8; int4:g64:sym x1.029,
89.0%, 13.9. The bounds below leave about 2x margin on the perplexity
ratio; a quantizer with a wrong offset or scale fails them by far.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax import decode
from specjax import models

V = 256
CONFIG = models.ModelConfig(
    arch="llama", vocab_size=V, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
SEQ = 64


def _text() -> np.ndarray:
  with open(textwrap.__file__, "rb") as f:
    return np.frombuffer(f.read(), np.uint8).astype(np.int32)


def _forward_logits(model, tokens):
  """tokens [B, T] -> logits [B, T, V] (one causal pass, empty cache)."""
  out, _ = model(tokens, model.init_cache(tokens.shape[0], tokens.shape[1]),
                 cache_is_empty=True)
  return out.logits


@pytest.fixture(scope="module")
def trained():
  """(float32 model, held-out windows [N, SEQ])."""
  data = _text()
  train, held = data[:-4096], data[-4096:]
  model = models.init_random(CONFIG, jax.random.key(0))
  opt = optax.adam(3e-3)

  def loss_fn(params, batch):
    logits = _forward_logits(model.replace(params=params), batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]).mean()

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  params, state = model.params, opt.init(model.params)
  rng = np.random.default_rng(0)
  for _ in range(300):
    starts = rng.integers(0, len(train) - SEQ - 1, 16)
    batch = jnp.asarray(np.stack([train[s:s + SEQ + 1] for s in starts]))
    params, state, loss = step(params, state, batch)
  assert float(loss) < 3.0  # it learnt something (log 256 = 5.5)
  windows = held[:len(held) // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1)
  return model.replace(params=params), jnp.asarray(windows)


@jax.jit
def _scores(model, windows):
  """(mean negative log-likelihood, argmax predictions [N, SEQ])."""
  logits = _forward_logits(model, windows[:, :-1])
  nll = optax.softmax_cross_entropy_with_integer_labels(
      logits, windows[:, 1:]).mean()
  return nll, jnp.argmax(logits, -1)


def _agreement_length(a, b):
  """Tokens two greedy outputs [B, N] share before they first part, per
  row, averaged."""
  same = np.cumprod(np.asarray(a) == np.asarray(b), axis=1)
  return float(same.sum(1).mean())


@pytest.mark.slow  # trains the tiny model first (300 Adam steps)
@pytest.mark.parametrize("spec,ppl_ratio,agree,length", [
    pytest.param("int8", 1.002, 0.98, 20, marks=pytest.mark.extended),
    ("int4", 1.03, 0.85, 6),
    pytest.param("int4:g64:sym", 1.06, 0.8, 6, marks=pytest.mark.extended),
])
def test_quantized_perplexity_and_greedy_agreement(trained, spec, ppl_ratio,
                                                   agree, length):
  model, windows = trained
  nll, argmax = _scores(model, windows)
  q = model.quantize(spec)
  q_nll, q_argmax = _scores(q, windows)
  ratio = float(np.exp(q_nll - nll))
  match = float(np.mean(np.asarray(argmax) == np.asarray(q_argmax)))
  prompts = [list(np.asarray(w[:16])) for w in windows[:8]]
  want = decode.generate(model, prompts, max_new_tokens=32).tokens
  got = decode.generate(q, prompts, max_new_tokens=32).tokens
  agreed = _agreement_length(want, got)
  print(f"{spec}: fp32 ppl {np.exp(float(nll)):.3f}, ratio {ratio:.4f}, "
        f"argmax match {match:.3f}, greedy agreement {agreed:.1f} / 32")
  assert np.exp(float(nll)) < 20
  assert 1 / ppl_ratio < ratio < ppl_ratio
  assert match >= agree
  assert agreed >= length
