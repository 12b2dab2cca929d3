"""The drafter protocol: how `speculate_step` gets proposals.

Shape letters: B batch, P padded prompt, G = γ, V vocab.

A drafter proposes up to G tokens per row with the distribution q each was
drawn from, and is told afterwards how many were accepted and which token
followed, so it can roll its own state back. The verifier never looks inside a
drafter's state, so n-gram lookup, early-exit self-drafting, Medusa/EAGLE heads
or cascades plug in by implementing these three methods. Drafters are pytrees
(e.g. `flax.struct.dataclass`) so they can be passed into `jax.jit`; their
static fields fix shapes.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax

from specjax import sampling


@flax.struct.dataclass(kw_only=True)
class Proposal:
  """Draft tokens for one speculative step.

  Attributes:
    tokens: [B, G] int32 drafted tokens (positions >= num_drafted are junk).
    q: [B, G, V] float32 distributions the tokens were drawn from, after the
      same sampling processing as the target's; None for a deterministic
      drafter (one-hot at each token; never materialised).
    num_drafted: [B] int32 in [0, G], how many leading tokens are proposed.
    num_forwards: [] int32 draft forward passes spent (for statistics; 0
      for a drafter that runs no model).
  """

  tokens: jax.Array
  num_drafted: jax.Array
  num_forwards: jax.Array
  q: jax.Array | None = None


class Drafter(Protocol):
  """Proposes tokens for the target to verify."""

  vocab_size: int

  def init(self, prompts: jax.Array, prompt_lengths: jax.Array,
           first_token: jax.Array, cache_size: int) -> Any:
    """Prefills the drafter.

    Args:
      prompts: [B, P] right-padded prompt ids.
      prompt_lengths: [B] int32.
      first_token: [B] int32, the token the target sampled after the prompt.
      cache_size: S, positions available per row.

    Returns:
      The drafter's state (a pytree).
    """

  def propose(self, state: Any, key: jax.Array,
              params: sampling.SamplingParams, gamma: int,
              stop_threshold: jax.Array) -> tuple[Proposal, Any]:
    """Drafts up to `gamma` tokens after every token committed so far.

    `stop_threshold` ([] float32) lets a drafter stop early when its top
    probability falls below it; unproposed positions keep static shapes.
    """

  def commit(self, state: Any, proposal: Proposal, num_accepted: jax.Array,
             next_token: jax.Array, active: jax.Array) -> Any:
    """Keeps `num_accepted` [B] draft tokens, then `next_token` [B].

    Rows where `active` [B] is False must be left as they were before
    `propose`.
    """
