"""Speculative sampling stays exact under history-dependent controls.

The counterpart of `test_step_distribution.py` with penalties, logit bias,
min-p and a regex mask: the same fixed-logit target and draft, one jitted
prefill and `speculate_step`, 20 000 rows. The reference is computed by enumeration
over all V^3 texts: each conditional is the target's logits after the
previous token, processed here in numpy by the Hugging Face repetition
penalty and the OpenAI presence / frequency penalties and bias over that
text's own history, then temperature / top-k / top-p / min-p; the
regex's mask at each text comes from outlines-core's own `Index` (not
`specjax.grammar`'s tables). The chi-square test must reject a verifier
whose positions ignore the drafted prefix (each draft position scored with
the committed history only: for a grammar, the mask of the committed text
only), for chains and for trees.
"""

import jax
import jax.numpy as jnp
import numpy as np
import outlines_core
import pytest

from specjax import controls as controls_lib
from specjax import drafters
from specjax import grammar as grammar_lib
from specjax import policies
from specjax import speculate
from test_distribution import _chi_square
from test_distribution import _reference_probs
from test_distribution import TREE_PROMPT
import test_step_distribution as steps
from test_step_distribution import _lookup
from test_step_distribution import _sampled_tree
from test_step_distribution import DRAFT
from test_step_distribution import NUM_SAMPLES
from test_step_distribution import NUM_TOKENS
from test_step_distribution import PROMPT
from test_step_distribution import T07_TOPK3
from test_step_distribution import T1
from test_step_distribution import TARGET
from test_step_distribution import TREE
from test_step_distribution import VOCAB


def _processed(logits, prompt, output, rep=None, presence=None,
               frequency=None, bias=None):
  """One conditional's logits after the controls, written from their
  definitions (Hugging Face's repetition penalty over prompt + output;
  the OpenAI penalties over the output)."""
  z = np.asarray(logits, np.float64).copy()
  counts = np.bincount(output, minlength=VOCAB)
  if rep is not None:
    seen = np.zeros(VOCAB, bool)
    seen[list(prompt) + list(output)] = True
    z = np.where(seen, np.where(z > 0, z / rep, z * rep), z)
  if frequency is not None:
    z -= counts * frequency
  if presence is not None:
    z -= (counts > 0) * presence
  if bias:
    for token, value in bias.items():
      z[token] += value
  return z


def _min_p(p, min_p):
  if min_p is None:
    return p
  p = np.where(p >= min_p * p.max(), p, 0.0)
  return p / p.sum()


# A regex over a vocabulary of V = 8 tokens (7 is EOS; 2 and 6 both spell
# "c"): "c" must be followed by "a" or "b", so the mask depends on the text.
EOS = VOCAB - 1
REGEX = "(a|b|c(a|b))+"
_VOCABULARY = outlines_core.Vocabulary(EOS, {
    b"a": [0], b"b": [1], b"c": [2, 6], b"ab": [3], b"ba": [4], b"x": [5]})


def _index_mask(text):
  """[V] bool the tokens outlines-core's `Index` allows after `text` (EOS
  keeps an accepting state where it is)."""
  index = outlines_core.Index(REGEX, _VOCABULARY)
  state = index.get_initial_state()
  for token in text:
    if token != EOS:
      state = index.get_next_state(state, token)
  mask = np.zeros(VOCAB, bool)
  mask[index.get_allowed_tokens(state)] = True
  return mask


def _exact_joint(settings, controls, min_p=None, prompt=PROMPT):
  """[V] * NUM_TOKENS: P(first NUM_TOKENS tokens), text by text."""
  table = np.asarray(TARGET.table)
  joint = np.zeros((VOCAB,) * NUM_TOKENS)
  controls = dict(controls)
  masked = controls.pop("grammar", False)
  for text in np.ndindex(*joint.shape):
    prob = 1.0
    for j, token in enumerate(text):
      last = prompt[-1] if j == 0 else text[j - 1]
      z = _processed(table[last], prompt, list(text[:j]), **controls)
      if masked:
        mask = _index_mask(text[:j])
        if not mask[token]:
          prob = 0.0
          break
        z = np.where(mask, z, -np.inf)
      prob *= _min_p(_reference_probs(z, *settings), min_p)[token]
    joint[text] = prob
  return joint


def _samples(drafter, policy, settings, controls, min_p=None, seed=3,
             prompt=PROMPT):
  temperature, top_k, top_p = settings
  names = dict(rep="repetition_penalty", presence="presence_penalty",
               frequency="frequency_penalty", bias="logit_bias",
               grammar="grammar")
  if controls.get("grammar"):
    controls = dict(controls, grammar=grammar_lib.compile_grammar(
        _VOCABULARY, regex=REGEX, eos_ids=[EOS], vocab_size=VOCAB))
  params = speculate.StepParams.create(
      temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
      controls=controls_lib.Controls.create(
          VOCAB, **{names[k]: v for k, v in controls.items()}))
  # `test_step_distribution._samples` with these params.
  prompts = jnp.tile(jnp.asarray([prompt], jnp.int32), (NUM_SAMPLES, 1))
  lengths = jnp.full((NUM_SAMPLES,), len(prompt), jnp.int32)
  state = steps._start(TARGET, drafter, policy, params, prompts, lengths,
                       jax.random.key(seed))
  for _ in range(NUM_TOKENS - 1):
    state = steps._step(state, TARGET, drafter, policy, params)
  assert np.all(np.asarray(state.num_generated) == NUM_TOKENS)
  return np.asarray(state.tokens[:, :NUM_TOKENS])


REP = dict(rep=2.5)
CASES = {
    "repetition-model-g2-t1": (lambda: drafters.DraftModel(DRAFT),
                               policies.Fixed(2), T1, REP, None),
    "frequency-presence-model-g3-t0.7-topk3": (
        lambda: drafters.DraftModel(DRAFT), policies.Fixed(3), T07_TOPK3,
        dict(frequency=1.2, presence=0.7), None),
    "combined-lookup-g2-t1": (
        _lookup, policies.Fixed(2), T1,
        dict(rep=1.5, frequency=0.5, bias={2: 1.5, 5: -1.0}), None),
    "min-p-model-g2-t1": (lambda: drafters.DraftModel(DRAFT),
                          policies.Fixed(2), T1, dict(frequency=0.6), 0.15),
    "repetition-tree-sampled-t1": (lambda: _sampled_tree(True), TREE, T1,
                                   REP, None),
    "frequency-tree-lookup-t1": (_lookup, TREE, T1, dict(frequency=1.5),
                                 None),
    "regex-model-g2-t1": (lambda: drafters.DraftModel(DRAFT),
                          policies.Fixed(2), T1, dict(grammar=True), None),
    "regex-repetition-tree-sampled-t0.7-topk3": (
        lambda: _sampled_tree(False), TREE, T07_TOPK3,
        dict(grammar=True, rep=1.5), None),
    "regex-lookup-g3-t1": (_lookup, policies.Fixed(3), T1,
                           dict(grammar=True), None),
}


def _prompt(policy):
  return TREE_PROMPT if policy is TREE else PROMPT


# The default suite checks one case per control family and path; the
# others and the power checks run in the slow step.
_SLOW_CASES = ("min-p-model-g2-t1", "frequency-tree-lookup-t1",
               "regex-lookup-g3-t1")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_CASES else c
    for c in sorted(CASES)])
def test_controlled_samples_match_exact_distribution(case):
  make, policy, settings, controls, min_p = CASES[case]
  prompt = _prompt(policy)
  joint = _exact_joint(settings, controls, min_p, prompt)
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  samples = _samples(make(), policy, settings, controls, min_p,
                     prompt=prompt)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


def _committed_only(self, *args):
  """A broken `along_chain` / `along_tree`: every position scored with the
  committed history, the drafted prefix ignored."""
  width = args[0].shape[1] + 1
  broadcast = lambda x: None if x is None else jnp.broadcast_to(
      x[:, None], (x.shape[0], width) + x.shape[1:])
  return self.replace(processors=tuple(
      p.replace(state=broadcast(p.state)) for p in self.processors))


@pytest.mark.slow
@pytest.mark.parametrize("method, case", [
    ("along_chain", "repetition-model-g2-t1"),
    ("along_tree", "repetition-tree-sampled-t1"),
    ("along_chain", "regex-model-g2-t1")])
def test_the_test_rejects_positions_that_ignore_the_drafted_prefix(
    steps_patch, method, case):
  make, policy, settings, controls, min_p = CASES[case]
  steps_patch(controls_lib.Controls, method, _committed_only)
  prompt = _prompt(policy)
  samples = _samples(make(), policy, settings, controls, min_p,
                     prompt=prompt)
  stat, critical = _chi_square(samples,
                               _exact_joint(settings, controls, min_p,
                                            prompt))
  assert stat > critical, (stat, critical)


@pytest.fixture
def steps_patch():
  """monkeypatch.setattr with the jitted prefill and step retraced under
  the patch and after it (`test_step_distribution.patch`)."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    steps._start.clear_cache()
    steps._step.clear_cache()
    yield monkeypatch.setattr
  steps._start.clear_cache()
  steps._step.clear_cache()
