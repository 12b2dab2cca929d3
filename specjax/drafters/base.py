"""The drafter protocol: how `speculate_step` gets proposals.

Shape letters (`specjax.shapes`): B batch, P padded prompt, G = γ, V vocab,
E hidden.

A drafter proposes up to G tokens per row with the distribution q each was
drawn from (or none, for a deterministic drafter), and is then handed the
target's `Verification`: how many were accepted, the tokens emitted, and the
target's logits and hidden states at the verified positions, so it can roll its
own state back or learn from the target without recomputing anything. The
verifier never looks inside a drafter's state, so n-gram lookup, early-exit
self-drafting, Medusa/EAGLE heads or cascades plug in by implementing these
three methods. Drafters are pytrees (e.g. `flax.struct.dataclass`) so they can
be passed into `jax.jit`; their static fields fix shapes.
"""

from __future__ import annotations

from typing import Any, Protocol, TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

from specjax import sampling
from specjax import tree

if TYPE_CHECKING:  # verify imports this module
  from specjax.verify import Verification


@flax.struct.dataclass(kw_only=True)
class Proposal:
  """Draft tokens for one speculative step.

  Attributes:
    tokens: [B, G] int32 drafted tokens (positions >= num_drafted are junk).
    q: [B, G, V] float32 distributions the tokens were drawn from, after the
      same sampling processing as the target's; None for a deterministic
      drafter (one-hot at each token; never materialised).
    num_drafted: [B] int32 in [0, G], how many leading tokens are proposed.
    num_forwards: [] int32 draft forward passes spent, or one count per
      component (`components`) for a drafter made of several (statistics
      only; 0 for a drafter that runs no model).
    parents: [B, G] int32 index of each token's parent among the drafts (-1:
      the last committed token), or None for a chain (parent of i is i - 1,
      `parent_indices`). Set, the proposal is a token tree of G = T nodes
      in topological order (`specjax.tree`); q, if given, is then the law
      each node was drawn from given its earlier siblings.
    depth: [B, T] int32 each tree node's depth (1 for the root's
      children), or None (computed from `parents` when needed).
    valid: [B, T] bool tree nodes that exist, or None: the first
      `num_drafted`.
    tree_depth: static, the deepest a tree's nodes may be (γ); 0 for a
      chain, whose depth is G.
  """

  tokens: jax.Array
  num_drafted: jax.Array
  num_forwards: jax.Array
  q: jax.Array | None = None
  parents: jax.Array | None = None
  depth: jax.Array | None = None
  valid: jax.Array | None = None
  tree_depth: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def max_depth(self) -> int:
    """γ: the deepest draft position (G for a chain)."""
    return self.tree_depth or self.tokens.shape[1]

  def node_mask(self) -> jax.Array:
    """[B, G] bool drafts that exist."""
    if self.valid is not None:
      return self.valid
    slots = jnp.arange(self.tokens.shape[1])[None]
    return slots < self.num_drafted[:, None]

  def node_depths(self) -> jax.Array:
    """[B, T] int32 tree node depths: `depth`, or computed from `parents`
    (a tree only)."""
    return self.depth if self.depth is not None else tree.depths(
        self.parents)

  def drafted_depths(self) -> jax.Array:
    """[B, γ] bool: whether some draft sits at depth d + 1."""
    if self.parents is None:
      return self.node_mask()
    levels = jnp.arange(1, self.max_depth + 1)[None, None]  # [1, 1, γ]
    return jnp.any(self.node_mask()[..., None]
                   & (self.node_depths()[..., None] == levels), axis=1)

  def parent_indices(self) -> jax.Array:
    """[B, G] int32 parents, the chain i - 1 when `parents` is None."""
    if self.parents is not None:
      return self.parents
    batch, gamma = self.tokens.shape
    return jnp.broadcast_to(jnp.arange(-1, gamma - 1, dtype=jnp.int32),
                            (batch, gamma))


class Drafter(Protocol):
  """Proposes tokens for the target to verify.

  Optional attributes: `components` (names of the parts whose forwards are
  counted apart, e.g. ("model", "lookup") for a cascade; a part named
  "model" is counted one prefill forward) and `extra_positions` (cache
  positions needed past the engine's γ + 1, default 0) and `gates_itself`
  (under a `limit` of zeros, `propose` runs nothing and proposes nothing,
  so the engine calls it without a `lax.cond`: `propose_if`). Optional
  method:
  `init_guess`, `init` that also returns the drafter's logits [B, V] for
  `first_token` where its prefill computes them (`DraftModel`), so an
  adaptive γ policy observes its first acceptance for free
  (`init_and_guess`).
  """

  vocab_size: int

  def init(self, prompts: jax.Array, prompt_lengths: jax.Array,
           first_token: jax.Array, cache_size: int) -> Any:
    """Prefills the drafter.

    Args:
      prompts: [B, P] right-padded prompt ids.
      prompt_lengths: [B] int32.
      first_token: [B] int32, the token the target sampled after the prompt.
      cache_size: S, positions available per row.

    A drafter with `uses_prompt_hidden = True` (EAGLE, `specjax.heads`)
    is also passed `prompt_hidden=` [B, P, E], the target's last hidden
    states over the prompts, from the target's own prefill.

    Returns:
      The drafter's state (a pytree).
    """

  def propose(self, state: Any, key: jax.Array,
              params: sampling.SamplingParams, gamma: int,
              stop_threshold: jax.Array,
              limit: jax.Array | None = None) -> tuple[Proposal, Any]:
    """Drafts up to `gamma` tokens after every token committed so far.

    `stop_threshold` ([] float32) lets a drafter stop early when its top
    probability falls below it; unproposed positions keep static shapes.
    `limit` ([B] int32 in [0, G], from an adaptive γ policy) caps each
    row's proposal; a model drafter stops its loop once every row reached
    its cap. Only adaptive policies pass it (`specjax.adaptive`), and the
    engine truncates proposals to it either way. A drafter with
    `supports_trees = True` also takes `num_nodes=T` (passed only for
    token trees) and then returns a tree of at most T nodes at depth at
    most `gamma` (`Proposal.parents`, `specjax.tree`).
    """

  def commit(self, state: Any, proposal: Proposal,
             verification: Verification,
             active: jax.Array) -> Any:
    """Takes in what the target committed after `proposal`.

    `verification` holds `num_accepted` [B], `emitted` [B, G+1] (the
    accepted drafts then the next token; `num_emitted` [B] of them are
    real), and the target's `logits` [B, G+1, V] and `hidden` [B, G+1, E]
    after the last committed token and each draft. Rows where `active` [B]
    is False keep the committed text they had before `propose`.

    `proposal` and the width of `emitted` may not be this drafter's own: a
    `Fallback` commits the proposal it chose into both its drafters, and a
    `Cascade` commits the target's verdict on its block into its inner
    drafter's state from before the block. A drafter must therefore take
    the committed text from `verification` alone.
    """


def cost_model(drafter: Any) -> Any:
  """The `LanguageModel` one of whose one-token forwards each drafted token
  costs (a drafter's `cost_model`, else its `model`), or None for a drafter
  that runs none (prompt lookup)."""
  if hasattr(drafter, "cost_model"):
    return drafter.cost_model
  return getattr(drafter, "model", None)


def capped(num_drafted: jax.Array, limit: jax.Array | None) -> jax.Array:
  """num_drafted [B] no larger than limit [B] (None: unchanged)."""
  return num_drafted if limit is None else jnp.minimum(num_drafted, limit)


def limit_kwargs(limit: jax.Array | None) -> dict[str, Any]:
  """`propose` keyword arguments passing `limit` on only when set, so a
  drafter that predates it still works under a fixed γ."""
  return {} if limit is None else {"limit": limit}


def propose_if(pred: jax.Array, propose: Any, state: Any,
               drafter: Any = None) -> tuple[Proposal, Any]:
  """`propose(state)` where pred ([] bool) holds; else a zero-filled
  proposal of the same shapes (nothing drafted) and the state unchanged.
  The drafter's `commit` still sees every step, so it stays in step.

  A `drafter` that `gates_itself` (`DraftModel`: under a `limit` that
  lets no row draft, its `propose` runs no model and proposes nothing)
  is run unconditionally, `propose` passing a limit that is zero on every
  row where pred fails: a `lax.cond` whose skipping branch passes the
  state through makes XLA copy it, whole, into and out of the branches at
  every step, for a draft model's cache a measurable share of a plain
  step.
  """
  if getattr(drafter, "gates_itself", False):
    return propose(state)

  def skip(s):
    shapes, _ = jax.eval_shape(propose, s)
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), s

  return jax.lax.cond(pred, propose, skip, state)


def pad_nodes(nodes: dict[str, jax.Array], num_nodes: int
              ) -> dict[str, jax.Array]:
  """Tree `Proposal` fields of N <= num_nodes nodes padded to num_nodes
  with invalid nodes (parent -1, depth 1, token 0)."""
  extra = num_nodes - nodes["tokens"].shape[1]
  if extra < 0:
    raise ValueError(f"{nodes['tokens'].shape[1]} nodes exceed num_nodes="
                     f"{num_nodes}.")
  pad = lambda x, value: jnp.pad(x, ((0, 0), (0, extra)),
                                 constant_values=value)
  return dict(nodes, tokens=pad(nodes["tokens"], 0),
              parents=pad(nodes["parents"], -1),
              depth=pad(nodes["depth"], 1), valid=pad(nodes["valid"], False))


def components(drafter: Any) -> tuple[str, ...]:
  """Names of the parts of a drafter whose forwards are counted apart."""
  return tuple(getattr(drafter, "components", ("drafter",)))


def init_and_guess(drafter: Any, prompts: jax.Array,
                   prompt_lengths: jax.Array, first_token: jax.Array,
                   cache_size: int, **extra: Any
                   ) -> tuple[Any, jax.Array | None]:
  """A drafter's state (`Drafter.init`) and its logits [B, V] for
  `first_token` from a drafter with `init_guess`, else None."""
  if hasattr(drafter, "init_guess") and not extra:
    return drafter.init_guess(prompts, prompt_lengths, first_token,
                              cache_size)
  return drafter.init(prompts, prompt_lengths, first_token, cache_size,
                      **extra), None


def extra_positions(drafter: Any) -> int:
  """Cache positions a drafter needs past the engine's γ + 1 (default 0)."""
  return int(getattr(drafter, "extra_positions", 0))


def where_rows(mask: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """Per row: a where mask [B] holds, else b (both [B, ...])."""
  return jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)


def forwards(proposal: Proposal, drafter: Any) -> jax.Array:
  """A proposal's forward count as [number of components] int32."""
  return jnp.broadcast_to(jnp.asarray(proposal.num_forwards, jnp.int32),
                          (len(components(drafter)),))


def dense_q(proposal: Proposal, vocab_size: int) -> jax.Array:
  """[B, G, V] q of a proposal, one-hot at each token where q is omitted."""
  if proposal.q is not None:
    return proposal.q
  return jax.nn.one_hot(proposal.tokens, vocab_size, dtype=jnp.float32)
