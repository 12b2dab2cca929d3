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

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import rejection
from specjax import sampling
from specjax.drafters.base import Proposal
from specjax.models.protocol import model_output


@flax.struct.dataclass(kw_only=True)
class Verification:
  """The target's verdict on a proposal.

  Attributes:
    num_accepted: [B] int32 leading draft tokens accepted.
    next_token: [B] int32 the token sampled after them (the correction on a
      rejection, a bonus token when all were accepted).
    emitted: [B, G+1] int32 what the step commits: the accepted drafts, then
      `next_token` (repeated past it).
    logits: [B, G+1, V] float32 the target's logits after the last committed
      token and after each draft.
    probs: [B, G+1, V] float32 the same after sampling processing (p).
    hidden: [B, G+1, E] the target's last hidden states at those positions,
      or None for a model that does not expose them.
  """

  num_accepted: jax.Array
  next_token: jax.Array
  emitted: jax.Array
  logits: jax.Array
  probs: jax.Array
  hidden: jax.Array | None = None

  @property
  def num_emitted(self) -> jax.Array:
    """[B] int32 tokens committed: the accepted drafts and the next token."""
    return self.num_accepted + 1


def emitted_tokens(drafts: jax.Array, num_accepted: jax.Array,
                   next_token: jax.Array) -> jax.Array:
  """[B, G] drafts, [B] accepted counts and next tokens -> [B, G+1] emitted
  (accepted drafts, then the next token, repeated past it)."""
  slots = jnp.arange(drafts.shape[1] + 1)[None]
  padded = jnp.concatenate([drafts, next_token[:, None]], axis=1)
  return jnp.where(slots < num_accepted[:, None], padded, next_token[:, None])


def verify(target: Any, cache: Any, last_token: jax.Array,
           proposal: Proposal, params: sampling.SamplingParams,
           key: jax.Array, *, synthetic_rate: jax.Array | None = None
           ) -> tuple[Verification, Any]:
  """Scores a chain proposal in one target pass and rejection-samples it.

  Args:
    target: a `specjax.models.LanguageModel`.
    cache: the target's cache; `cache.lengths` [B] holds every committed
      token but `last_token`.
    last_token: [B] int32 newest committed token.
    proposal: G drafts per row (a chain: `parents` None).
    params: sampling settings (the same the drafter used for q).
    key: PRNG key.
    synthetic_rate: if given ([] float32), accept each draft with this fixed
      probability instead of p/q (system benchmarks on random weights only;
      not distribution-preserving).

  Returns:
    The `Verification`, and the target's cache holding the last token and
    the accepted drafts (`lengths` advanced by `num_accepted + 1`).

  Raises:
    ValueError: for a tree proposal (`parents` set); chains only here.
  """
  if proposal.parents is not None:
    raise ValueError("verify handles chain proposals (parents=None); a "
                     "token tree needs a tree verifier.")
  start = cache.lengths
  chunk = jnp.concatenate([last_token[:, None], proposal.tokens], 1)
  out, cache = target(chunk, cache)  # [B, G+1] -> [B, G+1, V]
  out = model_output(out)
  p = sampling.probabilities(out.logits, params)  # [B, G+1, V]
  if synthetic_rate is None:
    num_accepted, next_token = rejection.rejection_sample(
        key, proposal.tokens, proposal.q, p, proposal.num_drafted)
  else:
    num_accepted, next_token = rejection.synthetic_sample(
        key, synthetic_rate, proposal.tokens, p, proposal.num_drafted)
  verification = Verification(
      num_accepted=num_accepted, next_token=next_token,
      emitted=emitted_tokens(proposal.tokens, num_accepted, next_token),
      logits=out.logits, probs=p, hidden=out.hidden)
  return verification, cache.rollback(start + 1 + num_accepted)
