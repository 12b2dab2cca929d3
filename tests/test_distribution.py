"""Speculative sampling reproduces the target's distribution exactly.

The reference is computed by enumeration: the target's full forward pass (no
cache) on every continuation of the prompt, processed by a numpy
implementation of temperature / top-k / top-p written here, chained into the
exact joint distribution of the first three generated tokens. 20 000
speculative samples are compared with it by a chi-square test; the same test
must reject samples whose draft tokens are returned unverified.
"""


import flax.struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode
from specjax import drafters
from specjax import models
from specjax import testing

VOCAB = 8
NUM_TOKENS = 3
NUM_SAMPLES = 20_000
PROMPT = [1, 2, 3]


def _peaked(config, seed):
  """A random tiny model whose logits spread over a few nats."""
  m = models.init_random(config.replace(vocab_size=VOCAB), jax.random.key(seed))
  params = dict(m.params, lm_head=m.params["lm_head"] * 10.0)
  return m.replace(params=params)


@pytest.fixture(scope="module")
def pair():
  return _peaked(testing.TINY_TARGET, 0), _peaked(testing.TINY_DRAFT, 1)


def _reference_probs(logits, temperature, top_k, top_p):
  z = np.asarray(logits, np.float64) / temperature
  if top_k:
    z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
  p = np.exp(z - z.max())
  p /= p.sum()
  if top_p < 1.0:
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < top_p]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
  return p


def _exact_joint(target, settings):
  """[V] * NUM_TOKENS array: P(first NUM_TOKENS tokens) under the target."""
  probs = {(): 1.0}
  for _ in range(NUM_TOKENS):
    prefixes = list(probs)
    seqs = np.array([PROMPT + list(p) for p in prefixes], np.int32)
    out, _ = target(seqs, target.init_cache(len(seqs), 16))
    longer = {}
    for prefix, row in zip(prefixes, np.asarray(out.logits[:, -1])):
      cond = _reference_probs(row, *settings)
      for tok in range(VOCAB):
        longer[prefix + (tok,)] = probs[prefix] * cond[tok]
    probs = longer
  joint = np.zeros((VOCAB,) * NUM_TOKENS)
  for seq, prob in probs.items():
    joint[seq] = prob
  return joint


def _chi_square(samples, joint):
  """Chi-square statistic and a 1e-4-level critical value (cells with an
  expected count under 5 are pooled)."""
  counts = np.zeros(joint.size)
  np.add.at(counts, np.ravel_multi_index(samples.T, joint.shape), 1)
  expected = joint.ravel() * len(samples)
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  stat = np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])
  df = keep.sum() - 1
  z = 3.719  # one-sided normal quantile at 1e-4 (Wilson-Hilferty below)
  critical = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
  return stat, critical


def _spec_samples(pair, gamma, settings, seed, **kw):
  temperature, top_k, top_p = settings
  out = decode.speculative_generate(
      pair[0], pair[1], [PROMPT] * NUM_SAMPLES, gamma=gamma,
      max_new_tokens=NUM_TOKENS, temperature=temperature, top_k=top_k,
      top_p=top_p, key=seed, cache_size=32, **kw)
  assert np.all(out.lengths == NUM_TOKENS)
  return out.tokens


@pytest.mark.parametrize("gamma, settings", [
    (2, (1.0, 0, 1.0)),
    (1, (0.7, 3, 1.0)),
    (3, (1.0, 0, 0.8)),
], ids=["t1", "t0.7-topk3", "topp0.8"])
def test_speculative_samples_match_exact_distribution(pair, gamma, settings):
  joint = _exact_joint(pair[0], settings)
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  samples = _spec_samples(pair, gamma, settings, seed=gamma)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@pytest.mark.parametrize("gamma, settings", [
    (3, (1.0, 0, 1.0)),
    (2, (0.7, 3, 1.0)),
], ids=["t1", "t0.7-topk3"])
def test_prompt_lookup_samples_match_exact_distribution(pair, gamma,
                                                        settings):
  # q is one-hot at the looked-up tokens and never materialised. With PROMPT
  # = [1, 2, 3], a first token in {1, 2, 3} makes lookup propose the rest of
  # the prompt, so proposals (and rejections) happen in most rows.
  joint = _exact_joint(pair[0], settings)
  lookup = drafters.PromptLookup(vocab_size=VOCAB, max_ngram=2, min_ngram=1)
  samples = _spec_samples((pair[0], lookup), gamma, settings, seed=11)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@pytest.mark.parametrize("kind, gamma, settings", [
    ("fallback", 3, (1.0, 0, 1.0)),
    ("fallback", 2, (0.7, 3, 1.0)),
    ("cascade", 3, (1.0, 0, 1.0)),
    ("cascade", 2, (0.7, 3, 1.0)),
], ids=["fallback-t1", "fallback-t0.7-topk3", "cascade-t1",
        "cascade-t0.7-topk3"])
def test_combined_drafters_match_exact_distribution(pair, kind, gamma,
                                                    settings):
  # Fallback: lookup where it matches, the draft model elsewhere (rows of
  # one batch take different drafters in the same step). Cascade: the draft
  # model drafts its block by speculative sampling over prompt lookup, so
  # q comes from its verification passes.
  joint = _exact_joint(pair[0], settings)
  lookup = drafters.PromptLookup(vocab_size=VOCAB, max_ngram=2, min_ngram=1)
  if kind == "fallback":
    drafter = drafters.Fallback(lookup, drafters.DraftModel(pair[1]))
  else:
    drafter = drafters.Cascade(pair[1], lookup, 2)
  samples = _spec_samples((pair[0], drafter), gamma, settings, seed=13)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


def test_the_test_rejects_the_draft_distribution(pair):
  settings = (1.0, 0, 1.0)
  joint = _exact_joint(pair[0], settings)
  # Accepting every draft token unverified returns the draft's distribution
  # for tokens 2 and 3.
  samples = _spec_samples(pair, 2, settings, seed=7, synthetic_acceptance=1.0)
  stat, critical = _chi_square(samples, joint)
  assert stat > critical, (stat, critical)


@flax.struct.dataclass
class _UniformQ:
  """Wraps a drafter and misreports q as uniform: a wrong law."""

  inner: object

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def propose(self, *args):
    proposal, state = self.inner.propose(*args)
    return proposal.replace(q=jnp.full_like(proposal.q, 1 / VOCAB)), state


def test_the_test_rejects_a_cascade_with_a_wrong_q(pair):
  settings = (1.0, 0, 1.0)
  joint = _exact_joint(pair[0], settings)
  lookup = drafters.PromptLookup(vocab_size=VOCAB, max_ngram=2, min_ngram=1)
  wrong = _UniformQ(drafters.Cascade(pair[1], lookup, 2))
  samples = _spec_samples((pair[0], wrong), 3, settings, seed=13)
  stat, critical = _chi_square(samples, joint)
  assert stat > critical, (stat, critical)
