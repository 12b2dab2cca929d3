"""Speculative sampling reproduces the target's distribution exactly.

The reference is computed by enumeration: the target's full forward pass (no
cache) on every continuation of the prompt, processed by a numpy
implementation of temperature / top-k / top-p written here, chained into the
exact joint distribution of the first three generated tokens. 20 000
speculative samples are compared with it by a chi-square test; the same test
must reject samples whose draft tokens are returned unverified.

These are whole generations through `speculative_generate` on tiny
transformers, each compiling its own loop. Every drafter, policy, tree and
sampling setting is checked at the step level, on fixed-logit models
(`test_step_distribution.py`); here are the drafters that need a
transformer (self-speculation, heads) and one case of each path that writes
a real KV cache differently (chains, cascades, `auto`'s widths, trees;
the last three with `-m extended`).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import policies
from specjax import decode
from specjax import drafters
from specjax import models
from specjax import testing

VOCAB = 8
NUM_TOKENS = 3
NUM_SAMPLES = 20_000
PROMPT = [1, 2, 3]
# The default suite keeps the draft model, early exit and Medusa heads; the
# other cases run with the slow tests.
_SLOW = pytest.mark.slow


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


def _exact_joint(target, settings, prompt=PROMPT):
  """[V] * NUM_TOKENS array: P(first NUM_TOKENS tokens) under the target.

  One causal forward (no cache reuse) over every prompt + continuation of
  NUM_TOKENS - 1 tokens gives every conditional: position len(prompt) - 1
  + j holds the distribution after the first j continuation tokens.
  """
  continuations = np.array(np.meshgrid(
      *[np.arange(VOCAB)] * (NUM_TOKENS - 1), indexing="ij")).reshape(
          NUM_TOKENS - 1, -1).T  # [V^(n-1), n-1]
  seqs = np.concatenate([np.tile(prompt, (len(continuations), 1)),
                         continuations], 1).astype(np.int32)
  logits = _logits(target, jnp.asarray(seqs))[:, len(prompt) - 1:]
  joint = np.ones((VOCAB,) * NUM_TOKENS)
  for j in range(NUM_TOKENS):
    for row, cont in enumerate(continuations):
      cond = _reference_probs(logits[row, j], *settings)
      # Every later token of this row is irrelevant to position j's law.
      index = tuple(cont[:j])
      if j < NUM_TOKENS - 1 and cont[j:].any():
        continue  # the same prefix appears once with zeros after it
      shape = (1,) * (NUM_TOKENS - 1 - j)
      joint[index] *= cond.reshape((VOCAB,) + shape)
  return joint


@jax.jit
def _logits(target, seqs):
  out, _ = target(seqs, target.init_cache(seqs.shape[0], seqs.shape[1]))
  return out.logits


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


def _spec_samples(pair, gamma, settings, seed, prompt=PROMPT, **kw):
  temperature, top_k, top_p = settings
  out = decode.speculative_generate(
      pair[0], pair[1], [prompt] * NUM_SAMPLES, gamma=gamma,
      max_new_tokens=NUM_TOKENS, temperature=temperature, top_k=top_k,
      top_p=top_p, key=seed, cache_size=32, **kw)
  assert np.all(out.lengths == NUM_TOKENS)
  return out.tokens


@_SLOW
def test_speculative_samples_match_exact_distribution(pair):
  settings = (1.0, 0, 1.0)
  joint = _exact_joint(pair[0], settings)
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  samples = _spec_samples(pair, 2, settings, seed=2)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@_SLOW
def test_speculative_samples_match_exact_distribution_in_bf16(pair):
  # dtype="auto" on accelerators: bf16 weights and caches, fp32 logits and
  # probabilities. The reference enumerates the bf16 target's own full
  # forwards.
  half = tuple(m.replace(params=jax.tree.map(
      lambda x: x.astype(jnp.bfloat16), m.params)) for m in pair)
  settings = (1.0, 0, 1.0)
  joint = _exact_joint(half[0], settings)
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  samples = _spec_samples(half, 2, settings, seed=3)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@_SLOW
@pytest.mark.extended
def test_cascade_matches_exact_distribution(pair):
  # The draft model drafts its block by speculative sampling over prompt
  # lookup, so q comes from its verification passes on its own cache.
  settings = (0.7, 3, 1.0)
  joint = _exact_joint(pair[0], settings)
  lookup = drafters.PromptLookup(vocab_size=VOCAB, max_ngram=2, min_ngram=1)
  drafter = drafters.Cascade(pair[1], lookup, 2)
  samples = _spec_samples((pair[0], drafter), 2, settings, seed=13)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@pytest.mark.parametrize("exit_layer, skip, gamma, settings", [
    pytest.param(1, (), 3, (1.0, 0, 1.0), marks=_SLOW),
    pytest.param(None, (0,), 2, (0.7, 3, 1.0),
                 marks=(_SLOW, pytest.mark.extended)),
], ids=["early-exit-t1", "skip-t0.7-topk3"])
def test_self_speculation_matches_exact_distribution(pair, exit_layer, skip,
                                                     gamma, settings):
  # The target's own first layer (early exit), or its last alone (layer
  # skipping), drafts with the target's head.
  joint = _exact_joint(pair[0], settings)
  drafter = drafters.EarlyExit(pair[0], exit_layer, skip=skip)
  samples = _spec_samples((pair[0], drafter), gamma, settings, seed=17)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@_SLOW
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_match_exact_distribution(pair, kind):
  # Random Medusa heads: each draft from its own head's law, whatever the
  # drafts before it (the first step drafts nothing: no hidden state yet).
  # A random EAGLE layer: a chain from the prompt's features on.
  joint = _exact_joint(pair[0], (1.0, 0, 1.0))
  drafter = (testing.random_medusa(pair[0], 3) if kind == "medusa"
             else testing.random_eagle(pair[0], scale=0.3))
  samples = _spec_samples((pair[0], drafter), 3, (1.0, 0, 1.0), seed=19)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


def _alternating(max_gamma):
  """`auto` that expects nothing accepted, with a dear verify pass and a
  probe after every plain step (a probe costing under a plain step):
  plain steps and drafting steps alternate within a generation (a run of
  drafting steps once the estimate passes 0.9)."""
  widths = policies.verify_widths(max_gamma)
  return policies.Auto.create(max_gamma=max_gamma,
                              target_ms=[1.0] + [1.9] * (len(widths) - 1),
                              prior=0.0, probe_every=1, probe_max=1)


@_SLOW
@pytest.mark.extended
def test_adaptive_gamma_matches_exact_distribution(pair):
  # `auto` alternates plain and drafting steps: verify passes of several
  # widths write the target's cache.
  settings = (0.7, 3, 1.0)
  joint = _exact_joint(pair[0], settings)
  samples = _spec_samples((pair[0], drafters.DraftModel(pair[1])),
                          _alternating(3), settings, seed=17)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


# Lookup finds two earlier "1"s here, so its tree branches at the root.
TREE_PROMPT = [1, 2, 1, 3, 1]


@_SLOW
@pytest.mark.extended
def test_token_trees_match_exact_distribution(pair):
  # The draft model's tree (3 nodes per depth, top-3 children) is scored in
  # both models' caches, and the accepted path is compacted into them.
  settings = (0.7, 3, 1.0)
  joint = _exact_joint(pair[0], settings, TREE_PROMPT)
  samples = _spec_samples((pair[0], drafters.DraftModel(pair[1])), 2,
                          settings, seed=19, prompt=TREE_PROMPT, num_nodes=6)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@_SLOW
@pytest.mark.extended
def test_the_test_rejects_the_draft_distribution(pair):
  settings = (1.0, 0, 1.0)
  joint = _exact_joint(pair[0], settings)
  # Accepting every draft token unverified returns the draft's distribution
  # for tokens 2 and 3.
  samples = _spec_samples(pair, 2, settings, seed=7, synthetic_acceptance=1.0)
  stat, critical = _chi_square(samples, joint)
  assert stat > critical, (stat, critical)
