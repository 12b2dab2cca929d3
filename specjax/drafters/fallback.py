"""`Fallback`: per row, a cheap drafter's proposal, else a second one's.

Shape letters (`specjax.shapes`): B batch, G = γ, V vocab.

Typical use: `Fallback(PromptLookup(V), DraftModel(small))`: where the
context repeats itself, the lookup drafts for free; elsewhere the model
drafts. The choice is per row and per step: a row takes the first
drafter's proposal when it proposes at least `min_tokens` tokens. The
second drafter runs only in steps where some row needs it (`lax.cond`),
and is told every commit either way, so it stays in step with the
committed text (`DraftModel` catches up on the tokens it missed in one
chunked pass).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.drafters.base import capped
from specjax.drafters.base import dense_q
from specjax.drafters.base import Drafter
from specjax.drafters.base import forwards
from specjax.drafters.base import propose_if
from specjax.drafters.base import where_rows
from specjax.models.protocol import LanguageModel
from specjax.step_types import Proposal


@flax.struct.dataclass(kw_only=True)
class FallbackState:
  """Both drafters' states.

  Attributes:
    first: the first drafter's state.
    second: the second drafter's state.
  """

  first: Any
  second: Any


@flax.struct.dataclass
class Fallback(Drafter):
  """Uses `first`'s proposal where it drafts >= `min_tokens`, else
  `second`'s. Both share the target's vocabulary."""

  first: Drafter
  second: Drafter
  min_tokens: int = flax.struct.field(pytree_node=False, default=1)

  def __post_init__(self):
    sizes = {self.first.vocab_size, self.second.vocab_size} - {None}
    if len(sizes) > 1:
      raise ValueError(
          f"Fallback drafters' vocabularies differ: {self.first.vocab_size} "
          f"and {self.second.vocab_size}.")
    if self.min_tokens < 1:
      raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}.")

  @property
  def vocab_size(self) -> int | None:
    """V, None until `for_target` where neither drafter has one."""
    return (self.first.vocab_size if self.first.vocab_size is not None
            else self.second.vocab_size)

  def for_target(self, target, tokenizer=None) -> "Fallback":
    return self.replace(first=self.first.for_target(target, tokenizer),
                        second=self.second.for_target(target, tokenizer))

  @property
  def components(self) -> tuple[str, ...]:
    return self.first.components + self.second.components

  @property
  def commits_text(self) -> bool:
    return self.first.commits_text and self.second.commits_text

  @property
  def extra_positions(self) -> int:
    return max(self.first.extra_positions, self.second.extra_positions)

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    return FallbackState(
        first=self.first.init(prompts, prompt_lengths, first_token,
                              cache_size),
        second=self.second.init(prompts, prompt_lengths, first_token,
                                cache_size))

  @property
  def cost_model(self) -> LanguageModel | None:
    return self.second.cost_model

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    key1, key2 = jax.random.split(key)
    p1, s1 = self.first.propose(state.first, key1, params, gamma,
                                stop_threshold, limit)
    use_first = capped(p1.num_drafted, limit) >= self.min_tokens  # [B]
    second_limit = limit
    if self.second.gates_itself:
      # Only the rows the first leaves short (`propose_if`).
      second_limit = jnp.where(use_first, 0,
                               gamma if limit is None else limit)
    p2, s2 = propose_if(
        ~jnp.all(use_first),
        lambda s: self.second.propose(s, key2, params, gamma, stop_threshold,
                                      second_limit),
        state.second, self.second)
    pick = lambda a, b: where_rows(use_first, a, b)
    q = None
    if p1.q is not None or p2.q is not None:
      q = pick(dense_q(p1, self.vocab_size), dense_q(p2, self.vocab_size))
    proposal = Proposal(
        tokens=pick(p1.tokens, p2.tokens),
        num_drafted=pick(p1.num_drafted, p2.num_drafted),
        num_forwards=jnp.concatenate([forwards(p1, self.first),
                                      forwards(p2, self.second)]),
        q=q)
    return proposal, FallbackState(first=s1, second=s2)

  def commit(self, state, proposal, verification, active):
    return FallbackState(
        first=self.first.commit(state.first, proposal, verification, active),
        second=self.second.commit(state.second, proposal, verification,
                                  active))
