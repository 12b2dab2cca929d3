"""The drafter protocol: how `speculate_step` gets proposals.

Shape letters (`specjax.shapes`): B batch, P padded prompt, G = γ, V vocab,
E hidden, T tree nodes.

A drafter proposes up to G tokens per row with the distribution q each was
drawn from (or none, for a deterministic drafter), and is then handed the
target's `Verification`: how many were accepted, the tokens emitted, and the
target's logits and hidden states at the verified positions, so it can roll
its own state back or learn from the target without recomputing anything.
The verifier never looks inside a drafter's state, so n-gram lookup,
early-exit self-drafting, Medusa/EAGLE heads or cascades plug in by
subclassing `Drafter`: three methods to write, and declared capabilities
whose defaults fit a simple drafter. Drafters are pytrees (e.g.
`flax.struct.dataclass`) so they can be passed into `jax.jit`; their static
fields fix shapes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.models.protocol import LanguageModel
from specjax.step_types import Proposal
from specjax.step_types import Verification


class Drafter:
  """Proposes tokens for the target to verify: subclass it.

  A subclass sets `vocab_size` (a field or property: V, the target's) and
  writes `init`, `propose` and `commit`. Everything else the engine asks of
  a drafter is declared here with a default:

  Attributes:
    components: names of the parts whose forwards are counted apart
      (`SpecStats.draft_forwards`), e.g. ("model", "lookup") for a
      cascade; a part named "model" is counted one prefill forward.
    extra_positions: cache positions needed past the engine's γ + 1 (a
      cascade's inner γ + 1).
    supports_trees: `propose` takes `num_nodes=T` and then returns a token
      tree of at most T nodes (`Proposal.parents`, `specjax.tree`).
    gates_itself: under a `limit` of zeros `propose` runs nothing and
      proposes nothing, so the engine calls it without a `lax.cond`
      (`propose_if`).
    uses_prompt_hidden: `init` takes `prompt_hidden=` [B, P, E], the
      target's last hidden states over the prompts (EAGLE).
    commits_text: `commit` reads the committed text alone
      (`verification.emitted` and `num_emitted`: no logits, hidden states
      or tree path), so a run of plain steps commits its tokens once
      after the run, G + 1 at a time (`specjax.plain`), instead of at
      each step.
    cost_model: the `LanguageModel` one of whose one-token forwards each
      drafted token costs (policies price drafting with it), or None for
      a drafter that runs no model.
  """

  components: ClassVar[tuple[str, ...]] = ("drafter",)
  extra_positions: ClassVar[int] = 0
  supports_trees: ClassVar[bool] = False
  gates_itself: ClassVar[bool] = False
  uses_prompt_hidden: ClassVar[bool] = False
  commits_text: ClassVar[bool] = False
  cost_model: ClassVar[LanguageModel | None] = None

  def init(self, prompts: jax.Array, prompt_lengths: jax.Array,
           first_token: jax.Array, cache_size: int, **kwargs: Any) -> Any:
    """Prefills the drafter.

    Args:
      prompts: [B, P] right-padded prompt ids.
      prompt_lengths: [B] int32.
      first_token: [B] int32, the token the target sampled after the prompt.
      cache_size: S, positions available per row.
      **kwargs: `prompt_hidden` [B, P, E], only for `uses_prompt_hidden`.

    Returns:
      The drafter's state (a pytree).
    """
    raise NotImplementedError

  def for_target(self, target: Any, tokenizer: Any = None) -> "Drafter":
    """This drafter with what it learns from `target` (a `LanguageModel`)
    and the decoder's tokenizer (None without one) filled in, e.g.
    `PromptLookup()`'s vocabulary size and control tokens; the decoders
    call it before they check vocabularies. The default returns it as
    is."""
    del target, tokenizer
    return self

  def init_guess(self, prompts: jax.Array, prompt_lengths: jax.Array,
                 first_token: jax.Array, cache_size: int, **kwargs: Any
                 ) -> tuple[Any, jax.Array | None]:
    """`init`, and the drafter's logits [B, V] for `first_token` where its
    prefill computes them anyway (`DraftModel`), so a γ policy observes a
    first acceptance for free; None (the default) where it does not."""
    return self.init(prompts, prompt_lengths, first_token, cache_size,
                     **kwargs), None

  def propose(self, state: Any, key: jax.Array,
              params: sampling.SamplingParams, gamma: int,
              stop_threshold: jax.Array, limit: jax.Array | None = None,
              **kwargs: Any) -> tuple[Proposal, Any]:
    """Drafts up to `gamma` tokens after every token committed so far.

    Args:
      state: the drafter's state.
      key: PRNG key.
      params: sampling settings (q must be processed as the target's p).
      gamma: G, static.
      stop_threshold: [] float32; a drafter may stop a row early when its
        top probability falls below it. Unproposed positions keep static
        shapes.
      limit: [B] int32 in [0, G], each row's budget from the γ policy, or
        None for G. A drafter may stop early once every row reached it
        (the engine caps proposals to it either way).
      **kwargs: `num_nodes=T`, only for `supports_trees`.

    Returns:
      The `Proposal` and the drafter's state.
    """
    raise NotImplementedError

  def commit(self, state: Any, proposal: Proposal,
             verification: Verification, active: jax.Array) -> Any:
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
    raise NotImplementedError


class TargetVocabulary:
  """A model-free drafter whose `vocab_size` (a static field, None by
  default) is the target's: `for_target` fills it in."""

  def for_target(self, target: Any, tokenizer: Any = None) -> Drafter:
    """This drafter with V = the target's when none was given."""
    del tokenizer
    if self.vocab_size is not None:
      return self
    return self.replace(vocab_size=target.vocab_size)


def capped(num_drafted: jax.Array, limit: jax.Array | None) -> jax.Array:
  """num_drafted [B] no larger than limit [B] (None: unchanged)."""
  return num_drafted if limit is None else jnp.minimum(num_drafted, limit)


def propose_if(pred: jax.Array, propose: Any, state: Any,
               drafter: Drafter) -> tuple[Proposal, Any]:
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
  if drafter.gates_itself:
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


def where_rows(mask: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """Per row: a where mask [B] holds, else b (both [B, ...])."""
  return jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)


def forwards(proposal: Proposal, drafter: Drafter) -> jax.Array:
  """A proposal's forward count as [number of components] int32."""
  return jnp.broadcast_to(jnp.asarray(proposal.num_forwards, jnp.int32),
                          (len(drafter.components),))


def dense_q(proposal: Proposal, vocab_size: int) -> jax.Array:
  """[B, G, V] q of a proposal, one-hot at each token where q is omitted."""
  if proposal.q is not None:
    return proposal.q
  return jax.nn.one_hot(proposal.tokens, vocab_size, dtype=jnp.float32)
