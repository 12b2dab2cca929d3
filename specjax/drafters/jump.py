"""`JumpForward`: the tokens a grammar forces, drafted for free.

Shape letters (`specjax.shapes`): B batch, G = γ.

Under structured output (`regex=` / `json_schema=`, `specjax.grammar`) the
automaton often leaves one allowed token: the quote after a key, a
schema's fixed field names, the closing braces. Those tokens are known
without running any model. `JumpForward` proposes, per row, the chain of
forced tokens from the row's committed automaton state (read from the
sampling settings' controls, `specjax.controls`), up to γ, with no q (a
deterministic drafter). Exact by construction: the target's processed
distribution at a forced position is one-hot at the forced token (the
mask leaves nothing else), so each is accepted with probability 1 and the
rejection sampler is unchanged.

Typical use: `Fallback(JumpForward(V), DraftModel(small))`: forced runs
are drafted free, and elsewhere the model drafts (it catches up on the
forced tokens it did not see in one chunked pass). It needs a grammar.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp

from specjax import grammar as grammar_lib
from specjax.drafters.base import capped
from specjax.drafters.base import Drafter
from specjax.step_types import Proposal


@flax.struct.dataclass
class JumpForward(Drafter):
  """Drafts the grammar's forced tokens; stateless."""

  vocab_size: int = flax.struct.field(pytree_node=False)

  components = ("jump",)

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    del prompts, prompt_lengths, first_token, cache_size
    return ()

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    del key, stop_threshold
    controls = params.controls
    if controls is None or controls.grammar is None:
      raise ValueError("JumpForward drafts the tokens a grammar forces: "
                       "pass regex= or json_schema= (and tokenizer=).")
    tokens, count = grammar_lib.forced_chain(
        controls.grammar, jnp.maximum(controls.state, 0), gamma)
    count = jnp.where(controls.state >= 0, count, 0)
    tokens = jnp.maximum(tokens, 0)  # [B, G], junk past `count`
    return Proposal(tokens=tokens, num_drafted=capped(count, limit),
                    num_forwards=jnp.int32(0)), state

  def commit(self, state, proposal, verification, active):
    del proposal, verification, active
    return state
