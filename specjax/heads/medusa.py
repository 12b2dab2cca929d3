"""Medusa heads (Cai et al. 2024) as a Flax module and a `Drafter`.

Shape letters (`specjax.shapes`): B batch, G = γ, V vocab, E hidden, K heads,
N positions.

Head k (1..K) reads the target's last hidden state h_t, the one whose LM
head output is token t+1, and predicts token t+1+k. Each head is a stack of
residual blocks x + SiLU(W x + b), initialised to the identity (W = 0, as
Medusa-1 does), followed by the target's own LM head, frozen and shared by
every head: a private [E, V] head per Medusa head would be as large as the
target's (hundreds of millions of parameters at V = 152k), and the K heads
then cost one read of the shared head (their rows go through it together).

As a drafter, `Medusa` proposes the K tokens of one step from the hidden
state of the target's last verification (`Verification.hidden` at the
accepted length), each drawn from its head's distribution after the same
sampling processing as the target's; that q does not depend on the earlier
drafts, which the rejection sampler allows, so the output is exactly the
target's. Before the first verification there is no hidden state (the
prompt's is inside the target's prefill), so the first step drafts
nothing.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.drafters.base import capped
from specjax.drafters.base import Drafter
from specjax.step_types import Proposal

__all__ = ["Medusa", "MedusaHeads", "MedusaState"]


class MedusaHeads(nn.Module):
  """K heads of `depth` residual blocks each over a hidden state.

  Attributes:
    num_heads: K.
    hidden_size: E.
    depth: residual blocks per head.
    param_dtype: dtype of the parameters.
  """

  num_heads: int
  hidden_size: int
  depth: int = 1
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> [..., K, E], one hidden state per head."""
    k, e = self.num_heads, self.hidden_size
    w = self.param("w", nn.initializers.zeros, (self.depth, k, e, e),
                   self.param_dtype)
    b = self.param("b", nn.initializers.zeros, (self.depth, k, e),
                   self.param_dtype)
    x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (k, e))
    for layer in range(self.depth):
      x = x + nn.silu(jnp.einsum("...ke,kef->...kf", x, w[layer]) + b[layer])
    return x


@flax.struct.dataclass(kw_only=True)
class MedusaState:
  """What `Medusa` carries between steps.

  Attributes:
    hidden: [B, E] the target's hidden state whose LM head output is the
      last committed token.
    ready: [B] bool rows that have one (after their first verification).
  """

  hidden: jax.Array
  ready: jax.Array


@flax.struct.dataclass
class Medusa(Drafter):
  """Drafts K tokens per step with Medusa heads on the target's hidden state.

  Attributes:
    target: the verified `Model`, whose LM head the heads share.
    params: the `MedusaHeads` parameters.
    num_heads: K (static).
    depth: residual blocks per head (static).
  """

  target: Any
  params: Any
  num_heads: int = flax.struct.field(pytree_node=False)
  depth: int = flax.struct.field(pytree_node=False, default=1)

  components = ("heads",)
  supports_trees = False

  @property
  def vocab_size(self) -> int:
    return self.target.vocab_size

  @property
  def module(self) -> MedusaHeads:
    return MedusaHeads(self.num_heads, self.target.config.hidden_size,
                       self.depth, param_dtype=self.target.dtype)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> [..., K, V] float32 logits of every head."""
    return self.target.logits(self.module.apply({"params": self.params},
                                                hidden))

  def init(self, prompts, prompt_lengths, first_token, cache_size):
    del prompt_lengths, first_token, cache_size
    batch = prompts.shape[0]
    return MedusaState(
        hidden=jnp.zeros((batch, self.target.config.hidden_size),
                         self.target.dtype),
        ready=jnp.zeros((batch,), bool))

  def propose(self, state, key, params, gamma, stop_threshold, limit=None):
    heads = min(gamma, self.num_heads)
    logits = self.logits(state.hidden)[:, :heads]  # [B, K', V]
    q = sampling.probabilities(logits, params)
    tokens = sampling.sample(key, q)  # [B, K']
    # A row stops at its first head below the confidence threshold.
    confident = sampling.top_probability(logits) >= stop_threshold
    leading = jnp.sum(jnp.cumprod(confident, axis=1), axis=1)
    num_drafted = jnp.where(state.ready, jnp.maximum(leading, 1), 0)
    pad = gamma - heads
    proposal = Proposal(
        tokens=jnp.pad(tokens, ((0, 0), (0, pad))),
        q=jnp.pad(q, ((0, 0), (0, pad), (0, 0))),
        num_drafted=capped(num_drafted.astype(jnp.int32), limit),
        num_forwards=jnp.int32(1))
    return proposal, state

  def commit(self, state, proposal, verification, active):
    del proposal
    if verification.hidden is None:
      raise ValueError("Medusa heads need the target's hidden states; this "
                       "target's forward does not return them.")
    at = verification.num_accepted[:, None, None]
    hidden = jnp.take_along_axis(verification.hidden, at, axis=1)[:, 0]
    return MedusaState(
        hidden=jnp.where(active[:, None], hidden.astype(state.hidden.dtype),
                         state.hidden),
        ready=state.ready | active)
