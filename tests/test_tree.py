"""Token trees: greedy equality, cache correctness, static shapes, errors.

Expectations come from autoregressive `generate` on the same target and
from a fresh prefill of the committed text; the distribution tests are in
test_distribution.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import policies
from specjax import decode
from specjax import loops
from specjax import drafters
from specjax import sampling
from specjax import tree
from specjax.drafters.base import Proposal
from specjax.verify import verify
from tests.test_drafter_protocol import _check_track_in_sync
from tests.test_drafter_protocol import _perturbed_draft
from tests.test_drafter_protocol import _run_steps

# Row 0 repeats itself (lookup finds several matches), row 1 is one token,
# row 2 counts up (no repeated n-gram).
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 8, 5, 6], [42], [7, 8, 9, 10, 11, 12, 13]]
MAX_NEW = 21


def _drafter(kind, pair):
  target, draft = pair
  return {"lookup": drafters.PromptLookup(target.vocab_size),
          "model": drafters.DraftModel(draft),
          # The target drafting for itself: every greedy path is accepted.
          "self": drafters.DraftModel(target)}[kind]


# The default suite keeps one tree per drafter, the slow step another
# depth and self-drafting, `-m extended` the other shapes.
_SLOW = pytest.mark.slow
_EXTENDED = (pytest.mark.slow, pytest.mark.extended)


@pytest.mark.parametrize("gamma, num_nodes", [
    pytest.param(1, 1, id="1-node", marks=_EXTENDED),
    pytest.param(4, 4, id="chain-4", marks=_EXTENDED),
    pytest.param(4, 16, id="16-nodes-depth-4"),
    pytest.param(3, 16, id="16-nodes-depth-3", marks=_SLOW),
    pytest.param(8, 64, id="64-nodes", marks=_EXTENDED)])
@pytest.mark.parametrize("kind", [
    "lookup", "model", pytest.param("self", marks=_SLOW)])
def test_greedy_equals_autoregressive(pair, baseline, kind, gamma,
                                      num_nodes):
  out = decode.speculative_generate(pair[0], _drafter(kind, pair), PROMPTS,
                                    gamma=gamma, num_nodes=num_nodes,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, baseline.tokens)
  np.testing.assert_array_equal(out.lengths, baseline.lengths)
  if kind == "self":
    # The root's most likely child is the greedy token: every step
    # accepts one at least; a chain (one node per depth) accepts all.
    accepted = out.stats.accepted[out.stats.accepted >= 0]
    assert accepted.min() >= 1
    if num_nodes == gamma:
      assert out.stats.steps <= -(-(MAX_NEW - 1) // (gamma + 1)) + 1


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
@pytest.mark.extended
def test_model_tree_children_are_the_top_tokens_after_their_path(pair):
  # Independent check of the draft's tree attention: every node's token is
  # among the `width` most likely tokens of a fresh forward over the
  # prompt and the node's parent path (children are picked from that
  # distribution, then pruned by path score).
  target, draft = pair
  gamma, num_nodes = 3, 12
  width = num_nodes // gamma
  drafter = drafters.DraftModel(draft)
  prompt = PROMPTS[0]
  first = decode.generate(target, [prompt], max_new_tokens=1).row(0)[0]
  state = drafter.init(jnp.array([prompt]), jnp.array([len(prompt)]),
                       jnp.array([first]), 64)
  params = sampling.SamplingParams.create(0.0, 0, 1.0)
  proposal, _ = drafter.propose(state, jax.random.key(0), params, gamma,
                                jnp.float32(0.0), num_nodes=num_nodes)
  tokens = np.asarray(proposal.tokens[0])
  parents = np.asarray(proposal.parents[0])
  assert np.asarray(proposal.valid[0]).all()
  for i in range(num_nodes):
    path, j = [], parents[i]
    while j >= 0:
      path.insert(0, int(tokens[j]))
      j = parents[j]
    text = prompt + [first] + path
    out, _ = draft(jnp.array([text]), draft.init_cache(1, 64))
    top = np.argsort(-np.asarray(out.logits[0, -1]))[:width]
    assert tokens[i] in top, (i, path)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_eos_inside_an_accepted_path(pair, baseline):
  target = pair[0]
  eos = int(baseline.tokens[2, 6])  # row 2 stops early, inside a path
  expected = decode.generate(target, PROMPTS, max_new_tokens=MAX_NEW,
                             eos_id=eos)
  out = decode.speculative_generate(target, _drafter("self", pair), PROMPTS,
                                    gamma=4, num_nodes=16, eos_id=eos,
                                    max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.lengths, expected.lengths)
  assert expected.lengths[2] < MAX_NEW


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_a_later_branch_commits_and_the_cache_matches_a_prefill(pair):
  # Greedy tokens g0 (committed, not cached), g1, g2, g3. Tree: root ->
  # [wrong, g1]; wrong -> [g2]; g1 -> [g2]; (g1, g2) -> [wrong]. The walk
  # must reject the first child, take the second branch to depth 2, and
  # leave the cache as a prefill of prompt + g0 g1 g2 would.
  target = pair[0]
  prompt = PROMPTS[2]
  g = decode.generate(target, [prompt], max_new_tokens=4).row(0)
  wrong = (g[1] + 1) % target.vocab_size
  bad = (g[3] + 1) % target.vocab_size
  tokens = jnp.array([[wrong, g[1], g[2], g[2], bad]], jnp.int32)
  parents = jnp.array([[-1, -1, 0, 1, 3]], jnp.int32)
  proposal = Proposal(tokens=tokens, parents=parents,
                      num_drafted=jnp.array([5]), num_forwards=jnp.int32(0),
                      tree_depth=3)
  cache = target.init_cache(1, 64)
  _, cache = target.prefill(jnp.array([prompt]), jnp.array([len(prompt)]),
                            cache)
  params = sampling.SamplingParams.create(0.0, 0, 1.0)
  result, cache = verify(target, cache, jnp.array([g[0]]), proposal, params,
                         jax.random.key(0))
  assert int(result.num_accepted[0]) == 2
  np.testing.assert_array_equal(result.emitted[0, :3], g[1:4])
  text = prompt + g[:3]
  assert int(cache.lengths[0]) == len(text)
  fresh = target.init_cache(1, 64)
  _, fresh = target.prefill(jnp.array([text]), jnp.array([len(text)]),
                            fresh)
  n = len(text)
  np.testing.assert_allclose(cache.k[:, 0, :n], fresh.k[:, 0, :n],
                             atol=1e-5)
  np.testing.assert_allclose(cache.v[:, 0, :n], fresh.v[:, 0, :n],
                             atol=1e-5)
  # And the next forward from either cache agrees.
  nxt = jnp.array([[g[3]]], jnp.int32)
  a, _ = target(nxt, cache)
  b, _ = target(nxt, fresh)
  np.testing.assert_allclose(a.logits, b.logits, atol=1e-4)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_tree_draft_keeps_the_accepted_path_cached(pair):
  # After each tree step the draft model's cache must hold the committed
  # text but its pending tokens, with the keys of a fresh prefill of it; the
  # accepted path's nodes are moved from their tree slots into place, not
  # fed again, so at most two tokens are pending (the next token, and the
  # path's deepest node, which the draft never scored) however many nodes
  # were accepted.
  target = pair[0]
  draft = _perturbed_draft(target)
  pending, accepted = set(), set()

  def check(state, prompts, lengths):
    for b in range(len(PROMPTS)):
      if not bool(state.done[b]):
        pending.add(_check_track_in_sync(state.drafter_state, state, prompts,
                                         lengths, draft, b))
    accepted.update(np.asarray(
        state.stats.accepted[:, int(state.stats.steps) - 1]).tolist())

  _run_steps(target, drafters.DraftModel(draft), PROMPTS, 3, MAX_NEW, check,
             num_nodes=9)
  assert max(accepted) >= 2, accepted  # paths of several nodes were kept
  assert pending <= {1, 2}, pending


def test_ancestor_mask_and_depths():
  # root -> 0 -> 1, root -> 2 -> 3 -> 4; node 5 invalid.
  parents = jnp.array([[-1, 0, -1, 2, 3, 0]])
  valid = jnp.array([[True, True, True, True, True, False]])
  np.testing.assert_array_equal(tree.depths(parents), [[1, 2, 1, 2, 3, 2]])
  mask = np.asarray(tree.ancestor_mask(parents, valid))[0]
  expected = np.zeros((7, 7), bool)
  chains = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 3], 4: [0, 3, 4],
            5: [0, 3, 4, 5], 6: [0, 6]}
  for row, cols in chains.items():
    expected[row, cols] = True
  np.testing.assert_array_equal(mask, expected)


def test_lookup_builds_a_trie_of_its_matches():
  # Context ... 5 6 | continuations after "5 6": "7 8", "9 8", "7 1":
  # the trie shares the first 7.
  context = jnp.array([[5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 1, 5, 6, 0, 0]])
  length = jnp.array([14])
  tokens, known = drafters.ngram_matches(context, length, gamma=2,
                                         max_ngram=2, min_ngram=2, count=3)
  np.testing.assert_array_equal(tokens[0], [[7, 1], [9, 8], [7, 8]])
  np.testing.assert_array_equal(known[0], [2, 2, 2])
  nodes = drafters.trie(tokens, known)
  np.testing.assert_array_equal(nodes["valid"][0],
                                [True, True, True, True, False, True])
  parents = np.asarray(nodes["parents"][0])
  np.testing.assert_array_equal(parents[[0, 1, 2, 3, 5]], [-1, 0, -1, 2, 0])
  np.testing.assert_array_equal(nodes["num_drafted"], [5])


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_changing_tree_contents_compiles_nothing(pair):
  target = pair[0]
  run = lambda prompts, kind="lookup", **kw: decode.speculative_generate(
      target, _drafter(kind, pair), prompts, gamma=4, num_nodes=16,
      max_new_tokens=8, **kw)
  run(PROMPTS)
  run(PROMPTS, kind="model")
  compiled = loops.speculative_loop._cache_size()
  run([[1, 2, 1, 2, 1], [3, 3, 3, 3, 3, 3], [9, 8, 7]])
  run([[4, 5, 6], [4], [4, 5, 4, 5, 4, 5, 4]], temperature=0.9, key=2)
  run([[4, 5, 6], [4], [1, 2]], kind="model", temperature=0.5, top_k=3)
  assert loops.speculative_loop._cache_size() == compiled


def test_errors_name_the_problem(pair):
  target, draft = pair
  lookup = drafters.PromptLookup(target.vocab_size)
  run = lambda drafter, **kw: decode.speculative_generate(
      target, drafter, PROMPTS, max_new_tokens=4, **kw)
  with pytest.raises(ValueError, match="num_nodes must be an integer >= "):
    run(lookup, gamma=4, num_nodes=3)
  with pytest.raises(ValueError, match="chains only"):
    run(drafters.Fallback(lookup, drafters.DraftModel(draft)), gamma=2,
        num_nodes=4)
  with pytest.raises(ValueError, match="fixed integer gamma"):
    run(lookup, gamma=policies.Heuristic(2), num_nodes=4)
  with pytest.raises(ValueError, match="num_nodes"):
    run(lookup, gamma=2, num_nodes=64, cache_size=70)
