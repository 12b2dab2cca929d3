"""`JumpForward`: the tokens a grammar forces, drafted for free.

Shape letters (`specjax.shapes`): B batch, G = γ.

Under structured output (`regex=` / `json_schema=`, `specjax.grammar`) the
automaton often forces text: the quote after a key, a schema's fixed field
names, the closing braces. That text is known without running any model.
`JumpForward` proposes, per row, the chain of forced tokens from the row's
committed automaton state (read from the sampling settings' controls,
`specjax.controls`; `grammar.forced`: the one allowed token, or the
longest token spelling forced text), up to γ, with no q (a deterministic
drafter). Exact by construction, as any deterministic proposal verified
by the rejection sampler is; where one token is allowed the target's
masked distribution is one-hot and it is accepted with probability 1,
and forced text the target splits into other tokens is rejected there.

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
from specjax.drafters.base import TargetVocabulary
from specjax.processors import GrammarMask
from specjax.step_types import Proposal


@flax.struct.dataclass
class JumpForward(TargetVocabulary, Drafter):
  """Drafts the grammar's forced tokens; stateless.

  Attributes:
    vocab_size: V; None (the default) takes the target's (`for_target`).
  """

  vocab_size: int | None = flax.struct.field(pytree_node=False,
                                             default=None)

  components = ("jump",)
  commits_text = True

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    del prompts, prompt_lengths, first_token, cache_size
    return ()

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    del key, stop_threshold
    mask = None if params.controls is None else params.controls.find(
        GrammarMask)
    if mask is None:
      raise ValueError("JumpForward drafts the tokens a grammar forces: "
                       "pass regex= or json_schema= (and tokenizer=).")
    tokens, count = grammar_lib.forced_chain(
        mask.grammar, jnp.maximum(mask.state, 0), gamma)
    count = jnp.where(mask.state >= 0, count, 0)
    tokens = jnp.maximum(tokens, 0)  # [B, G], junk past `count`
    return Proposal(tokens=tokens, num_drafted=capped(count, limit),
                    num_forwards=jnp.int32(0)), state

  def commit(self, state, proposal, verification, active):
    del proposal, verification, active
    return state
