"""One jitted `speculate_step` keeps the target's distribution exactly.

The step-level counterpart of `test_distribution.py`: target and draft are
`testing.FixedLogitsModel`s (logits depend on the previous token only), so
a program holds no transformer and compiles in seconds. The prefill
(`loops.init_spec_state`) and one `speculate_step` are each jitted once per
case; two steps give every row at least three tokens. The reference is
exact: the target's chain from the prompt's last token, each conditional
processed by the numpy temperature / top-k / top-p of
`test_distribution._reference_probs`, multiplied out over all V^3 texts.
20 000 rows are compared with it by the same chi-square test, which must
reject a sampler that resamples from p, a wrong q, a tree verifier that
keeps no residual and the draft's own chain.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance
from specjax import drafters
from specjax import loops
from specjax import policies
from specjax import rejection
from specjax import sampling
from specjax import speculate
from specjax import testing
from specjax import tree
from specjax.drafters import track
from specjax.drafters.base import pad_nodes
from specjax.drafters.base import Proposal
from test_distribution import _alternating
from test_distribution import _chi_square
from test_distribution import _reference_probs
from test_distribution import TREE_PROMPT

VOCAB = 8
NUM_TOKENS = 3
NUM_SAMPLES = 20_000
PROMPT = [1, 2, 3]
T1, T07_TOPK3, TOPP08 = (1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.8)


def _tables():
  """[V, V] target and draft logits: peaked rows, the draft's a noisy copy
  (acceptance well inside (0, 1), so a wrong q shows)."""
  target = 2.5 * jax.random.normal(jax.random.key(0), (VOCAB, VOCAB))
  noise = 2.0 * jax.random.normal(jax.random.key(1), (VOCAB, VOCAB))
  return target, target + noise


TARGET, DRAFT = (testing.FixedLogitsModel(t) for t in _tables())


def _exact_joint(settings, prompt=PROMPT):
  """[V] * NUM_TOKENS: P(first NUM_TOKENS tokens) of the target's chain."""
  step = np.stack([_reference_probs(row, *settings)
                   for row in np.asarray(TARGET.table)])  # [V, V]
  joint = step[prompt[-1]]  # [V]: the first token after the prompt
  for _ in range(NUM_TOKENS - 1):  # times P(next | the last token so far)
    joint = joint[..., None] * step.reshape((1,) * (joint.ndim - 1)
                                            + step.shape)
  return joint


def synthetic(rate):
  """The acceptance rule of `synthetic_acceptance=rate` (None: exact)."""
  return (acceptance.Exact() if rate is None
          else acceptance.Synthetic.create(rate))


@jax.jit
def _start(target, drafter, policy, params, prompts, lengths, key):
  return loops.init_spec_state(target, drafter, prompts, lengths, params, key,
                               policy=policy, max_new_tokens=NUM_TOKENS,
                               cache_size=16)


@jax.jit
def _step(state, target, drafter, policy, params):
  # Models, prompts and settings are arguments, not constants: XLA would
  # otherwise fold the sampling over all rows into the compile.
  num_nodes = policy.num_nodes if isinstance(policy, policies.Fixed) else None
  return speculate.speculate_step(
      state, target=target, drafter=drafter, params=params, policy=policy,
      max_new_tokens=NUM_TOKENS, num_nodes=num_nodes)


def _samples(drafter, policy, settings, seed, prompt=PROMPT,
             synthetic_acceptance=None):
  """[NUM_SAMPLES, NUM_TOKENS] first tokens of NUM_SAMPLES rows, from one
  prefill and NUM_TOKENS - 1 steps (each emits one token at least)."""
  temperature, top_k, top_p = settings
  params = speculate.StepParams.create(
      temperature=temperature, top_k=top_k, top_p=top_p,
      acceptance=synthetic(synthetic_acceptance))
  prompts = jnp.tile(jnp.asarray([prompt], jnp.int32), (NUM_SAMPLES, 1))
  lengths = jnp.full((NUM_SAMPLES,), len(prompt), jnp.int32)
  state = _start(TARGET, drafter, policy, params, prompts, lengths,
                 jax.random.key(seed))
  for _ in range(NUM_TOKENS - 1):
    state = _step(state, TARGET, drafter, policy, params)
  assert np.all(np.asarray(state.num_generated) == NUM_TOKENS)
  return np.asarray(state.tokens[:, :NUM_TOKENS])


def _lookup():
  return drafters.PromptLookup(vocab_size=VOCAB, max_ngram=2, min_ngram=1)


@flax.struct.dataclass
class _SampledTree(drafters.Drafter):
  """Test drafter: `width` children of the root drawn from the draft's q
  (with or without replacement), each with one deterministic child (its
  token + 1). q per node is the law it was drawn from given its earlier
  siblings: q, q renormalised without them, or one-hot."""

  inner: drafters.DraftModel
  width: int = flax.struct.field(pytree_node=False)
  replace: bool = flax.struct.field(pytree_node=False)

  vocab_size = VOCAB
  components = ("model",)
  supports_trees = True

  def init(self, *args):
    return self.inner.init(*args)

  def commit(self, *args):
    return self.inner.commit(*args)

  def propose(self, state, key, params, gamma, stop_threshold, limit=None,
              num_nodes=None):
    del stop_threshold, limit
    logits, state, passes = track.catch_up(self.inner.model, state,
                                           width=gamma + 1)
    q = sampling.probabilities(logits, params)  # [B, V]
    laws, children = [], []
    left = q
    for k in jax.random.split(key, self.width):
      law = q if self.replace else left
      child = sampling.sample(k, law)
      laws.append(law)
      children.append(child)
      left = left * (1.0 - jax.nn.one_hot(child, VOCAB))
      left = left / jnp.maximum(jnp.sum(left, -1, keepdims=True), 1e-30)
    grand = [(c + 1) % VOCAB for c in children]
    tokens = jnp.stack(children + grand, 1)  # [B, 2W]
    q_nodes = jnp.stack(laws + [jax.nn.one_hot(g, VOCAB) for g in grand], 1)
    batch = tokens.shape[0]
    parents = jnp.array([-1] * self.width + list(range(self.width)))
    nodes = pad_nodes(dict(
        tokens=tokens, parents=jnp.broadcast_to(parents, tokens.shape),
        depth=jnp.broadcast_to(jnp.array([1] * self.width + [2] * self.width),
                               tokens.shape),
        valid=jnp.ones(tokens.shape, bool),
        num_drafted=jnp.full((batch,), 2 * self.width)), num_nodes)
    q_nodes = jnp.pad(q_nodes, ((0, 0), (0, num_nodes - 2 * self.width),
                                (0, 0)))
    return Proposal(q=q_nodes, num_forwards=passes, tree_depth=gamma,
                    **nodes), state


@flax.struct.dataclass
class _UniformQ(drafters.Drafter):
  """Wraps a drafter and misreports q as uniform: a wrong law."""

  inner: drafters.Drafter

  vocab_size = property(lambda self: self.inner.vocab_size)
  components = property(lambda self: self.inner.components)
  extra_positions = property(lambda self: self.inner.extra_positions)

  def init(self, *args, **kwargs):
    return self.inner.init(*args, **kwargs)

  def commit(self, *args):
    return self.inner.commit(*args)

  def propose(self, *args, **kwargs):
    proposal, state = self.inner.propose(*args, **kwargs)
    return proposal.replace(q=jnp.full_like(proposal.q, 1 / VOCAB)), state


def _sampled_tree(replace):
  return _SampledTree(drafters.DraftModel(DRAFT), width=3, replace=replace)


# Trees (`Fixed(2, num_nodes=6)`) start from TREE_PROMPT, where lookup
# branches at the root.
TREE = policies.Fixed(2, num_nodes=6)
CASES = {
    "model-g2-t1": (lambda: drafters.DraftModel(DRAFT), policies.Fixed(2), T1),
    "model-g1-t0.7-topk3": (lambda: drafters.DraftModel(DRAFT),
                            policies.Fixed(1), T07_TOPK3),
    "model-g3-topp0.8": (lambda: drafters.DraftModel(DRAFT),
                         policies.Fixed(3), TOPP08),
    "lookup-g3-t1": (_lookup, policies.Fixed(3), T1),
    "lookup-g2-t0.7-topk3": (_lookup, policies.Fixed(2), T07_TOPK3),
    "fallback-g3-t1": (lambda: drafters.Fallback(
        _lookup(), drafters.DraftModel(DRAFT)), policies.Fixed(3), T1),
    "cascade-g3-t0.7-topk3": (lambda: drafters.Cascade(DRAFT, _lookup(), 2),
                              policies.Fixed(3), T07_TOPK3),
    "heuristic-model-t1": (lambda: drafters.DraftModel(DRAFT),
                           policies.Heuristic(3, initial=1), T1),
    "auto-model-t0.7-topk3": (lambda: drafters.DraftModel(DRAFT),
                              _alternating(3), T07_TOPK3),
    "auto-lookup-t1": (_lookup, _alternating(3), T1),
    "tree-lookup-t1": (_lookup, TREE, T1),
    "tree-model-t0.7-topk3": (lambda: drafters.DraftModel(DRAFT), TREE,
                              T07_TOPK3),
    "tree-sampled-with-replacement-t1": (lambda: _sampled_tree(True), TREE,
                                         T1),
    "tree-sampled-without-replacement-t0.7-topk3": (
        lambda: _sampled_tree(False), TREE, T07_TOPK3),
}


def _prompt(policy):
  return TREE_PROMPT if policy is TREE else PROMPT


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_samples_match_exact_distribution(case):
  make, policy, settings = CASES[case]
  joint = _exact_joint(settings, _prompt(policy))
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  samples = _samples(make(), policy, settings, seed=3, prompt=_prompt(policy))
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


@pytest.fixture
def patch():
  """monkeypatch.setattr for the library, with `_start` and `_step`
  retraced under the patch and again after it (their caches would keep
  the patched programs otherwise)."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    _start.clear_cache()
    _step.clear_cache()
    yield monkeypatch.setattr
  _start.clear_cache()
  _step.clear_cache()


def test_the_test_rejects_a_sampler_that_resamples_from_p(patch):
  # Accepting by min(1, p/q) but drawing a rejected position's token from
  # p instead of norm(max(0, p - q)) (no draft law at the rejection) is
  # biased towards the draft. (Ignoring q altogether is not: verifying a
  # sampled draft as a deterministic guess, accept x with probability p(x)
  # and else draw from p without x, emits p exactly, at a lower acceptance
  # rate. So the controls break the sampler in ways that bias it.)
  patch(rejection, "q_at", lambda q, draft_tokens, proposed, index, vocab:
        jnp.zeros((len(index), vocab)))
  samples = _samples(drafters.DraftModel(DRAFT), policies.Fixed(2), T1,
                     seed=3)
  stat, critical = _chi_square(samples, _exact_joint(T1))
  assert stat > critical, (stat, critical)


def test_the_test_rejects_a_cascade_with_a_wrong_q():
  samples = _samples(_UniformQ(drafters.Cascade(DRAFT, _lookup(), 2)),
                     policies.Fixed(3), T1, seed=3)
  stat, critical = _chi_square(samples, _exact_joint(T1))
  assert stat > critical, (stat, critical)


def test_the_test_rejects_a_tree_verifier_without_residuals(patch):
  # Trying each child against the unchanged p (accepting the first that
  # passes, never updating the residual) is biased.
  patch(tree, "residual_after", lambda residual, q: residual)
  samples = _samples(_sampled_tree(True), TREE, T1, seed=3,
                     prompt=TREE_PROMPT)
  stat, critical = _chi_square(samples, _exact_joint(T1, TREE_PROMPT))
  assert stat > critical, (stat, critical)


def test_the_test_rejects_the_draft_distribution():
  # Accepting every draft unverified returns the draft's chain for tokens
  # 2 and 3.
  samples = _samples(drafters.DraftModel(DRAFT), policies.Fixed(2), T1,
                     seed=7, synthetic_acceptance=1.0)
  stat, critical = _chi_square(samples, _exact_joint(T1))
  assert stat > critical, (stat, critical)
