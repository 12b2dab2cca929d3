"""`verify`: the target scores a proposal in one pass and rejection-samples it.

Shape letters (`specjax.shapes`): B batch, G = γ draft tokens, V vocab, E
hidden.

A pure function of the target, its cache and a `Proposal`, so
`speculate_step` and drafters that verify inside their own `propose` (a
cascade verifying a small draft with a middle model) share it. The target
scores the last committed token and the G drafts as one static-shape chunk
at each row's own cache offset; rows accept different counts and the cache
comes back rolled back to each row's own committed length.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.acceptance import Acceptance
from specjax.acceptance import Drafts
from specjax.acceptance import Exact
from specjax import tree
from specjax.models.protocol import declared
from specjax.models.protocol import LanguageModel
from specjax.models.protocol import model_output
from specjax.models.protocol import ModelOutput
from specjax.step_types import emitted_tokens
from specjax.step_types import Proposal
from specjax.step_types import Verification

__all__ = ["Verification", "verify", "verify_tree", "verify_widths",
           "verify_within", "width_index"]


def verify_widths(max_gamma: int) -> tuple[int, ...]:
  """Target chunk lengths T compiled for a γ_max: 1, then 2^i + 1 below
  G + 1, then G + 1 (e.g. G = 8: 1, 2, 3, 5, 9)."""
  if isinstance(max_gamma, bool) or int(max_gamma) != max_gamma or (
      max_gamma < 1):
    raise ValueError(f"max_gamma must be an integer >= 1, got {max_gamma!r}.")
  widths = {1, max_gamma + 1}
  step = 1
  while step + 1 < max_gamma + 1:
    widths.add(step + 1)
    step *= 2
  return tuple(sorted(widths))


def width_index(widths: Sequence[int], num_tokens: jax.Array) -> jax.Array:
  """Index of the smallest width >= num_tokens ([...] int32)."""
  return jnp.searchsorted(jnp.asarray(widths, jnp.int32), num_tokens,
                          side="left").astype(jnp.int32)


def verify(target: LanguageModel, cache: Any, last_token: jax.Array,
           proposal: Proposal, params: sampling.SamplingParams,
           key: jax.Array, *, acceptance: Acceptance = Exact()
           ) -> tuple[Verification, Any]:
  """Scores a proposal in one target pass and rejection-samples it.

  Args:
    target: a `specjax.models.LanguageModel`.
    cache: the target's cache; `cache.lengths` [B] holds every committed
      token but `last_token`.
    last_token: [B] int32 newest committed token.
    proposal: G drafts per row (a chain: `parents` None).
    params: sampling settings (the same the drafter used for q).
    key: PRNG key.
    acceptance: the rule that judges the drafts (`specjax.acceptance`;
      default exact rejection sampling).

  Returns:
    The `Verification`, and the target's cache holding the last token and
    the accepted drafts (`lengths` advanced by `num_accepted + 1`).

  A tree proposal (`parents` set) goes to `verify_tree`.
  """
  if proposal.parents is not None:
    return verify_tree(target, cache, last_token, proposal, params, key,
                       acceptance=acceptance)
  start = cache.lengths
  verification, _, cache = _score(target, cache, last_token, proposal,
                                  params, key, acceptance)
  return verification, cache.rollback(start + 1 + verification.num_accepted)


def _score(target: LanguageModel, cache: Any, last_token: jax.Array,
           proposal: Proposal, params: sampling.SamplingParams,
           key: jax.Array, acceptance: Acceptance, **model_kw
           ) -> tuple[Verification, ModelOutput, Any]:
  """`verify`'s target pass over a chain and its rejection sampling.

  Returns the `Verification`, the pass's `ModelOutput` (with
  `write_cache=False` in `model_kw`, its `keys`/`values` are the chunk's,
  for the caller to write) and the cache after the pass (not rolled
  back)."""
  first = cache.lengths + 1  # [B] the drafts' first sequence position
  chunk = jnp.concatenate([last_token[:, None], proposal.tokens], 1)
  out, cache = target(chunk, cache, **model_kw)  # [B, G+1] -> [B, G+1, V]
  out = model_output(out)
  # Position i's distribution reads the history through draft i - 1.
  p = sampling.probabilities(
      out.logits, params.along_chain(proposal.tokens))  # [B, G+1, V]
  num_accepted, next_token = acceptance.judge(key, Drafts(
      tokens=proposal.tokens, q=proposal.q, p=p,
      num_drafted=proposal.num_drafted, positions=first))
  verification = Verification(
      num_accepted=num_accepted, next_token=next_token,
      emitted=emitted_tokens(proposal.tokens, num_accepted, next_token),
      logits=out.logits, probs=p, hidden=out.hidden, experts=out.experts)
  return verification, out, cache


def verify_tree(target: LanguageModel, cache: Any, last_token: jax.Array,
                proposal: Proposal, params: sampling.SamplingParams,
                key: jax.Array, *, acceptance: Acceptance = Exact()
                ) -> tuple[Verification, Any]:
  """Scores a token tree in one target pass and walks it (`specjax.tree`).

  The root (`last_token`) and the T nodes go through the target as one
  chunk at each row's cache offset, node i at position `length +
  depth[i]` under the ancestor mask. The accepted path's keys and values
  are then moved to consecutive slots after the root
  (`KVCache.compact`, only those slots written) and the cache is rolled
  back to the root plus the path.

  Args:
    as `verify`; `proposal.parents` [B, T] is set, `proposal.depth` gives
    node depths (or they are computed) and `proposal.valid` the nodes that
    exist.

  Returns:
    The `Verification` along the accepted path (`emitted`, `logits`,
    `probs`, `hidden` at the root and the G deepest positions), and the
    cache.
  """
  if not acceptance.walks_trees:
    raise ValueError(f"{type(acceptance).__name__} acceptance verifies "
                     "chains only, not token trees.")
  start = cache.lengths
  valid = proposal.node_mask()
  depth = proposal.node_depths()  # [B, T]
  gamma = proposal.max_depth
  chunk = jnp.concatenate([last_token[:, None], proposal.tokens], 1)
  positions = start[:, None] + jnp.concatenate(
      [jnp.zeros_like(depth[:, :1]), depth], 1)  # [B, T+1]
  mask = tree.ancestor_mask(proposal.parents, valid)
  out, cache = target(chunk, cache, positions=positions, mask=mask)
  out = model_output(out)  # logits [B, T+1, V]
  # Node i's distribution reads the history through its own path.
  p = sampling.probabilities(out.logits, params.along_tree(
      proposal.tokens, proposal.parents, mask[:, 1:, 1:]))
  result = tree.walk(key, proposal.tokens, proposal.parents, valid,
                     proposal.q, p, gamma, acceptance.child)
  slots = tree.path_slots(result.path, result.num_accepted)  # [B, G]
  along = jnp.concatenate([jnp.zeros_like(slots[:, :1]), slots], 1)
  take = lambda x: None if x is None else jnp.take_along_axis(
      x, along.reshape(along.shape + (1,) * (x.ndim - 2)), axis=1)
  path_tokens = jnp.take_along_axis(chunk, slots, axis=1)  # [B, G]
  cache = cache.rollback(start + 1).compact(start[:, None] + slots,
                                            start + 1)
  verification = Verification(
      num_accepted=result.num_accepted, next_token=result.next_token,
      emitted=emitted_tokens(path_tokens, result.num_accepted,
                             result.next_token),
      logits=take(out.logits), probs=take(p), hidden=take(out.hidden),
      path=slots, experts=out.experts)
  return verification, cache.rollback(start + 1 + result.num_accepted)


def _pad_steps(x: jax.Array | None, width: int,
               axis: int = 1) -> jax.Array | None:
  """x with its T axis (`axis`, e.g. [B, T, ...]) zero-padded to
  `width`."""
  if x is None:
    return None
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, width - x.shape[axis])
  return jnp.pad(x, pad)


def verify_within(widths: Sequence[int], target: LanguageModel,
                  cache: Any, last_token: jax.Array, proposal: Proposal,
                  params: sampling.SamplingParams, key: jax.Array, *,
                  acceptance: Acceptance = Exact()
                  ) -> tuple[Verification, Any, jax.Array]:
  """`verify` over the smallest of several compiled widths that holds the
  proposal (`lax.switch`), so a short proposal costs a short pass.

  Args:
    widths: T values compiled, ascending: one width (a fixed γ: plain
      `verify` over all G drafts, chains and trees alike), or from 1 (a plain
      autoregressive step) to G + 1 (`verify_widths`; chains only).
    target, cache, last_token, params, key, acceptance: as in `verify`.
    proposal: G drafts (a tree: G = T nodes); rows propose `num_drafted`
      of them.

  Returns:
    The `Verification` at full width (G + 1 positions; logits, probs and
    hidden zero past the pass), the cache, and the draft slots the pass
    scored ([] int32, T - 1).

  A target that declares it can return a chunk's keys and values instead
  of writing them (`DeclaredModel.defers_cache_writes`: a `Model`) only
  reads its cache inside the branches, and the keys and values are
  written once after the switch (G + 1 slots per row; those past the pass
  are zeros beyond the row's length, never read): a branch that wrote in
  place would make XLA copy the whole cache at every step (a measurable
  share of a step at B = 8).
  """
  gamma = proposal.tokens.shape[1]
  if len(widths) == 1:  # every step verifies all it drafted
    verification, cache = verify(target, cache, last_token, proposal, params,
                                 key, acceptance=acceptance)
    return verification, cache, jnp.int32(gamma)
  if widths[0] != 1 or widths[-1] != gamma + 1:
    raise ValueError(f"widths must run from 1 to G + 1 = {gamma + 1}, got "
                     f"{tuple(widths)}.")
  branch = width_index(widths, jnp.max(proposal.num_drafted) + 1)
  start = cache.lengths
  # A model that declares nothing (`declared`) is verified in place.
  deferred = declared(target).defers_cache_writes

  def at(width):
    def run(cache):
      sub = proposal.replace(
          tokens=proposal.tokens[:, :width - 1],
          q=None if proposal.q is None else proposal.q[:, :width - 1],
          num_drafted=jnp.minimum(proposal.num_drafted, width - 1))
      if deferred:
        v, out, _ = _score(target, cache, last_token, sub, params, key,
                           acceptance, write_cache=False)
        # [L, B, T, K, D] -> [L, B, G+1, K, D].
        cache = (_pad_steps(out.keys, gamma + 1, axis=2),
                 _pad_steps(out.values, gamma + 1, axis=2))
      else:
        v, cache = verify(target, cache, last_token, sub, params, key,
                          acceptance=acceptance)
      return (v.num_accepted, v.next_token,
              _pad_steps(v.logits, gamma + 1), _pad_steps(v.probs, gamma + 1),
              _pad_steps(v.hidden, gamma + 1), v.experts, cache)
    return run

  (num_accepted, next_token, logits, probs, hidden, experts,
   result) = jax.lax.switch(branch, [at(w) for w in widths], cache)
  cache = (cache.write(*result, start) if deferred else result).rollback(
      start + 1 + num_accepted)
  verification = Verification(
      num_accepted=num_accepted, next_token=next_token,
      emitted=emitted_tokens(proposal.tokens, num_accepted, next_token),
      logits=logits, probs=probs, hidden=hidden, experts=experts)
  return verification, cache, jnp.asarray(widths, jnp.int32)[branch] - 1
