"""`PromptLookup`: n-gram prompt-lookup drafting, in the graph.

Shape letters (`specjax.shapes`): B batch, S context buffer (cache size), P
padded prompt, G = γ draft tokens.

Each row keeps its context, prompt plus committed tokens, in a fixed
[B, S] buffer. To draft, the row's last n tokens are looked up among the
earlier positions of its context, for n from `max_ngram` down to
`min_ngram`; at the most recent earlier occurrence of the longest n that
matches, the up to G tokens that followed it are proposed (Saxena 2023,
"prompt lookup decoding"; transformers' `prompt_lookup_num_tokens`). No
model runs: `num_forwards` is 0. A row with no match proposes nothing
(`num_drafted` 0), so its step is a plain target step.

A continuation stops before a control token (`control_ids`: a chat
template's, `Tokenizer.special_ids`), and an occurrence followed by one is
no match: in a chat prompt they mark the ends of turns, which the reply
being drafted does not repeat. Without that, a reply that opens a code
fence after a prompt whose code closed one is drafted, at its first step,
what followed the closing fence: `<|im_end|>` and the next turn's header.

The drafter is deterministic: q is one-hot at each proposed token, so the
proposal omits q and the rejection sampler accepts token x with
probability p(x) and, on a rejection, draws from p with x removed and
renormalised, which keeps the target's distribution exactly.

The match is vectorised over rows and candidate positions: for each n, n
shifted comparisons of the [B, S] buffer, with no loop over S.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.drafters import text
from specjax.drafters.base import capped
from specjax.drafters.base import Drafter
from specjax.drafters.base import pad_nodes
from specjax.drafters.base import TargetVocabulary
from specjax.step_types import Proposal

__all__ = ["LookupState", "PromptLookup", "ngram_match", "ngram_matches",
           "trie"]


def _control(tokens: jax.Array, control_ids: tuple[int, ...]
             ) -> jax.Array:
  """[...] bool: which of `tokens` [...] are among `control_ids`."""
  if not control_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[..., None] == jnp.asarray(control_ids, tokens.dtype),
                 axis=-1)


def _before_control(tokens: jax.Array, known: jax.Array,
                    control_ids: tuple[int, ...]) -> jax.Array:
  """`known` [...] cut before the first control token of `tokens`
  [..., G]."""
  control = _control(tokens, control_ids)  # [..., G]
  clear = jnp.where(jnp.any(control, -1), jnp.argmax(control, -1),
                    tokens.shape[-1])
  return jnp.minimum(known, clear)


def ngram_match(context: jax.Array, length: jax.Array, *, gamma: int,
                max_ngram: int, min_ngram: int,
                control_ids: tuple[int, ...] = ()
                ) -> tuple[jax.Array, jax.Array]:
  """Proposes the continuation of the latest earlier match of the suffix.

  Args:
    context: [B, S] int32 token buffer; positions >= `length` are junk.
    length: [B] int32 valid tokens per row.
    gamma: G, the most tokens proposed (static).
    max_ngram: the longest suffix tried first (static).
    min_ngram: the shortest suffix tried (static).
    control_ids: ids a continuation stops before; an occurrence followed
      by one is no match (static).

  Returns:
    tokens [B, G] int32 (junk past the count) and num_drafted [B] int32 in
    [0, G]: the tokens that followed the most recent earlier occurrence of
    the longest matching suffix, as many as are known.
  """
  batch, size = context.shape
  starts = jnp.arange(size)[None]  # [1, S] candidate match starts
  best = jnp.full((batch,), -1, jnp.int32)  # start of the chosen match
  best_n = jnp.zeros((batch,), jnp.int32)
  for n in range(max_ngram, min_ngram - 1, -1):
    # suffix [B, n]: the row's last n tokens.
    suffix = text.window(context, length - n, n)
    match = jnp.ones((batch, size), bool)
    for i in range(n):  # context[b, s + i] == suffix[b, i] for all i < n
      shifted = jnp.roll(context, -i, axis=1)  # [B, S]: context[b, s + i]
      match &= shifted == suffix[:, i:i + 1]
    # An earlier occurrence, followed by at least one known token, not a
    # control token.
    match &= (starts + n < length[:, None]) & (length[:, None] >= n)
    match &= ~_control(jnp.roll(context, -n, axis=1), control_ids)
    latest = jnp.max(jnp.where(match, starts, -1), axis=1)  # [B]
    take = (best < 0) & (latest >= 0)
    best = jnp.where(take, latest, best)
    best_n = jnp.where(take, n, best_n)
  first = best + best_n  # [B] first proposed position
  tokens = text.window(context, first, gamma)  # [B, G]
  num = jnp.where(best >= 0, jnp.clip(length - first, 0, gamma), 0)
  num = _before_control(tokens, num, control_ids)
  return tokens.astype(jnp.int32), num.astype(jnp.int32)


def ngram_matches(context: jax.Array, length: jax.Array, *, gamma: int,
                  max_ngram: int, min_ngram: int, count: int,
                  control_ids: tuple[int, ...] = ()
                  ) -> tuple[jax.Array, jax.Array]:
  """The continuations of the `count` best earlier matches of the suffix.

  Candidates are ranked by the longest n that matches before them, then by
  recency (the order `ngram_match` picks its one match in).

  Args:
    context, length, gamma, max_ngram, min_ngram, control_ids: as in
      `ngram_match`.
    count: K, matches kept (static).

  Returns:
    tokens [B, K, G] int32 and their known counts [B, K] int32 in [0, G]
    (0 for a missing match).
  """
  batch, size = context.shape
  follow = jnp.arange(size)[None]  # [1, S] the first proposed position c
  rank = jnp.full((batch, size), -1, jnp.int32)
  for n in range(min_ngram, max_ngram + 1):
    suffix = text.window(context, length - n, n)  # [B, n]
    match = (follow >= n) & (follow < length[:, None]) & (
        length[:, None] >= n) & ~_control(context, control_ids)
    for i in range(n):  # context[b, c - n + i] == suffix[b, i]
      match &= jnp.roll(context, n - i, axis=1) == suffix[:, i:i + 1]
    rank = jnp.where(match, n * size + follow, rank)
  best, where = jax.lax.top_k(rank, count)  # [B, K]
  tokens = jax.vmap(lambda c, starts: jax.vmap(
      lambda s: jax.lax.dynamic_slice_in_dim(
          jnp.pad(c, (0, gamma)), s, gamma))(starts))(context, where)
  known = jnp.where(best >= 0, jnp.clip(length[:, None] - where, 0, gamma),
                    0)
  known = _before_control(tokens, known, control_ids)
  return tokens.astype(jnp.int32), known.astype(jnp.int32)


def trie(tokens: jax.Array, known: jax.Array) -> dict[str, jax.Array]:
  """K candidate continuations -> a token tree of K·G nodes (a trie).

  Node k·G + d is token d of candidate k. Candidates that share a prefix
  share its nodes: a node that repeats an earlier candidate's prefix is
  invalid, and its children hang off the earlier node, so siblings are
  distinct tokens. Candidates keep their order among siblings.

  Args:
    tokens: [B, K, G] int32.
    known: [B, K] int32 tokens known per candidate.

  Returns:
    `Proposal` fields: tokens, parents, depth [B, K·G] int32, valid [B, K·G]
    bool, num_drafted [B] int32.
  """
  batch, count, gamma = tokens.shape
  exists = jnp.arange(gamma)[None, None] < known[..., None]  # [B, K, G]
  same = jnp.cumprod(tokens[:, :, None] == tokens[:, None], axis=-1,
                     dtype=jnp.int32).astype(bool)  # [B, K, K', G]
  same &= exists[:, None]  # candidate k' has the node too
  first = jnp.argmax(same, axis=2)  # [B, K, G] earliest sharing candidate
  valid = exists & (first == jnp.arange(count)[None, :, None])
  depth = jnp.broadcast_to(jnp.arange(gamma), (batch, count, gamma))
  parents = jnp.where(depth == 0, -1,
                      jnp.roll(first, 1, axis=2) * gamma + depth - 1)
  flat = lambda x: x.reshape(batch, count * gamma)
  return dict(tokens=flat(tokens), parents=flat(parents),
              depth=flat(depth + 1), valid=flat(valid),
              num_drafted=jnp.sum(valid, axis=(1, 2), dtype=jnp.int32))


@flax.struct.dataclass(kw_only=True)
class LookupState:
  """A row's context for lookup.

  Attributes:
    context: [B, S] int32 prompt then committed tokens.
    length: [B] int32 valid tokens per row.
  """

  context: jax.Array
  length: jax.Array


@flax.struct.dataclass
class PromptLookup(TargetVocabulary, Drafter):
  """Drafts by n-gram lookup in the row's own context; no model.

  Attributes:
    vocab_size: V, the target's vocabulary (lookup never leaves the ids it
      saw, but the engine checks vocabularies match). None (the default)
      takes the target's: the decoders fill it in (`for_target`).
    max_ngram: longest suffix looked up first.
    min_ngram: shortest suffix looked up.
    control_ids: ids a continuation stops before, and that no match may
      be followed by (see the module docstring). None (the default) takes
      the tokenizer's control tokens where a decoder has a tokenizer
      (`for_target`), else none; () none.
  """

  vocab_size: int | None = flax.struct.field(pytree_node=False,
                                             default=None)
  max_ngram: int = flax.struct.field(pytree_node=False, default=3)
  min_ngram: int = flax.struct.field(pytree_node=False, default=1)
  control_ids: tuple[int, ...] | None = flax.struct.field(
      pytree_node=False, default=None)

  components = ("lookup",)
  supports_trees = True
  commits_text = True

  def __post_init__(self):
    if not isinstance(self.min_ngram, int) or self.min_ngram < 1:
      raise ValueError(f"PromptLookup needs min_ngram >= 1, got "
                       f"{self.min_ngram!r}.")
    if not isinstance(self.max_ngram, int) or self.max_ngram < self.min_ngram:
      raise ValueError(f"PromptLookup needs max_ngram >= min_ngram, got "
                       f"max_ngram={self.max_ngram!r}, min_ngram="
                       f"{self.min_ngram!r}.")
    if self.control_ids is not None:
      object.__setattr__(self, "control_ids",
                         tuple(sorted({int(i) for i in self.control_ids})))

  def for_target(self, target, tokenizer=None) -> "PromptLookup":
    """V = the target's where none was given, and the control tokens the
    tokenizer names (`special_ids`) where none were."""
    lookup = super().for_target(target, tokenizer)
    if lookup.control_ids is None and tokenizer is not None:
      lookup = lookup.replace(control_ids=tuple(tokenizer.special_ids))
    return lookup

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    """Context = prompt then the target's first token, in [B, S]."""
    context, length = text.init(prompts, prompt_lengths, first_token,
                                cache_size)
    return LookupState(context=context, length=length)

  def propose(self, state: LookupState, key, params, gamma, stop_threshold,
              limit=None, num_nodes=None) -> tuple[Proposal, LookupState]:
    del key, params, stop_threshold  # deterministic; no confidence to read
    if num_nodes is not None:
      return self._tree(state, gamma, num_nodes), state
    tokens, num = ngram_match(state.context, state.length, gamma=gamma,
                              max_ngram=self.max_ngram,
                              min_ngram=self.min_ngram,
                              control_ids=self.control_ids or ())
    return Proposal(tokens=tokens, q=None, num_drafted=capped(num, limit),
                    num_forwards=jnp.int32(0)), state

  def _tree(self, state: LookupState, gamma: int, num_nodes: int
            ) -> Proposal:
    """Up to num_nodes // γ matches as branches of a trie (`trie`)."""
    count = num_nodes // gamma
    tokens, known = ngram_matches(
        state.context, state.length, gamma=gamma, max_ngram=self.max_ngram,
        min_ngram=self.min_ngram, count=count,
        control_ids=self.control_ids or ())
    nodes = pad_nodes(trie(tokens, known), num_nodes)
    return Proposal(q=None, num_forwards=jnp.int32(0), tree_depth=gamma,
                    **nodes)

  def commit(self, state: LookupState, proposal: Proposal, verification,
             active: jax.Array) -> LookupState:
    """Appends the emitted tokens to active rows' contexts."""
    del proposal
    context, length = text.append(state.context, state.length,
                                  verification.emitted,
                                  verification.num_emitted, active)
    return LookupState(context=context, length=length)
