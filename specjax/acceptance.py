"""How the target judges drafts: the `Acceptance` protocol and its rules.

Shape letters (`specjax.shapes`): B batch, G = γ draft tokens, V vocab.

A rule has one method, `judge`: given the drafts, the laws q they were
drawn from and the target's processed distributions p, how many leading
drafts each row keeps and the token drawn after them. Rules are pytrees
(`flax.struct.dataclass`): their settings are traced, so changing one never
recompiles, and the rule's class fixes the program.

- `Exact`: speculative rejection sampling (`specjax.rejection`). The output
  is distributed exactly as the target's.
- `Typical`, `Relaxed`: lossy rules that accept longer blocks. NOT
  distribution-preserving; outputs say `lossless=False`.
- `Synthetic`: verdicts at a fixed rate, for timing random-weight models.
  NOT distribution-preserving; outputs say `synthetic=True`.

Each rule declares what it is (`lossless`, `synthetic`) and whether it can
also walk a token tree (`walks_trees`, with `child`: the verdict on one
tried child). A new rule is one class here or in the caller's own code.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import rejection
from specjax import sampling

__all__ = ["Acceptance", "Drafts", "Exact", "RULES", "Relaxed", "Synthetic",
           "Typical", "from_name"]


@flax.struct.dataclass(kw_only=True)
class Drafts:
  """What one verification pass judges.

  Attributes:
    tokens: [B, G] int32 drafts (G may be 0: a plain autoregressive step).
    q: [B, G, V] float32 the laws the drafts were drawn from, or None for a
      deterministic drafter (one-hot at each draft).
    p: [B, G+1, V] float32 the target's processed distributions at the G
      draft positions and the one after them.
    num_drafted: [B] int32 <= G drafts each row proposed, or None for all.
    positions: [B] int32 sequence position of each row's first draft.
  """

  tokens: jax.Array
  q: jax.Array | None
  p: jax.Array
  num_drafted: jax.Array | None
  positions: jax.Array


class Acceptance(Protocol):
  """A verification rule.

  Attributes:
    lossless: the output keeps the target's distribution.
    synthetic: verdicts come from a fixed rate, not from p and q.
    walks_trees: the rule also judges token trees (`child`).
  """

  lossless: ClassVar[bool]
  synthetic: ClassVar[bool]
  walks_trees: ClassVar[bool]

  def judge(self, key: jax.Array, drafts: Drafts
            ) -> tuple[jax.Array, jax.Array]:
    """num_accepted [B] int32 in [0, G] and next_token [B] int32."""


@flax.struct.dataclass
class Exact:
  """Speculative rejection sampling: x_i kept with probability
  min(1, p_i(x_i) / q_i(x_i)), the next token from the residual
  (`rejection.rejection_sample`)."""

  lossless: ClassVar[bool] = True
  synthetic: ClassVar[bool] = False
  walks_trees: ClassVar[bool] = True

  def judge(self, key: jax.Array, drafts: Drafts
            ) -> tuple[jax.Array, jax.Array]:
    return rejection.rejection_sample(key, drafts.tokens, drafts.q,
                                      drafts.p, drafts.num_drafted)

  def child(self, u: jax.Array, q_x: jax.Array, r_x: jax.Array
            ) -> jax.Array:
    """[B] bool: a tried child kept, by uniform u [B], its draft law's
    q_x [B] and the residual's r_x [B] at its token (`tree.walk`)."""
    return u * q_x < r_x


def _unit(name: str, value: float) -> np.ndarray:
  """A setting in (0, 1] as a numpy float32, or an error naming it."""
  if not 0.0 < float(value) <= 1.0:
    raise ValueError(f"{name} must be in (0, 1], got {value}.")
  return np.float32(value)


@flax.struct.dataclass(kw_only=True)
class Typical:
  """Medusa's typical acceptance (Cai et al. 2024): x_i is kept iff
  p_i(x_i) > min(ε, δ · exp(-H(p_i))); the next token is drawn from p.
  Under greedy decoding it keeps exactly the argmax, as `Exact` does.

  Attributes:
    epsilon: [] float32 ε, the hard threshold.
    delta: [] float32 δ, the entropy-scaled threshold.
  """

  epsilon: jax.Array
  delta: jax.Array
  lossless: ClassVar[bool] = False
  synthetic: ClassVar[bool] = False
  walks_trees: ClassVar[bool] = False

  @classmethod
  def create(cls, epsilon: float = 0.09, delta: float = 0.3) -> "Typical":
    """Validated settings (Medusa's defaults)."""
    return cls(epsilon=_unit("typical_epsilon", epsilon),
               delta=_unit("typical_delta", delta))

  def judge(self, key: jax.Array, drafts: Drafts
            ) -> tuple[jax.Array, jax.Array]:
    batch, gamma = drafts.tokens.shape
    if gamma == 0:
      return rejection.no_drafts(key, drafts.p)
    _, next_key = jax.random.split(key)
    probs = drafts.p[:, :gamma]  # [B, G, V]
    entropy = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(probs), 0.0),
                       axis=-1)  # [B, G]
    bar = jnp.minimum(self.epsilon, self.delta * jnp.exp(-entropy))
    keep = rejection.gather(probs, drafts.tokens) > bar
    keep &= rejection.proposed_mask(drafts.num_drafted, batch, gamma)
    num_accepted = rejection.leading_true(keep)
    return num_accepted, sampling.sample(
        next_key, rejection.at_position(drafts.p, num_accepted))


@flax.struct.dataclass(kw_only=True)
class Relaxed:
  """Rejection sampling against λq: x_i kept with probability
  min(1, p_i(x_i) / (λ q_i(x_i))), the next token from norm(max(0, p -
  λq)). λ = 1 is `Exact`; a smaller λ keeps more.

  Attributes:
    threshold: [] float32 λ in (0, 1].
  """

  threshold: jax.Array
  lossless: ClassVar[bool] = False
  synthetic: ClassVar[bool] = False
  walks_trees: ClassVar[bool] = False

  @classmethod
  def create(cls, threshold: float = 0.5) -> "Relaxed":
    return cls(threshold=_unit("acceptance_threshold", threshold))

  def judge(self, key: jax.Array, drafts: Drafts
            ) -> tuple[jax.Array, jax.Array]:
    return rejection.rejection_sample(key, drafts.tokens, drafts.q,
                                      drafts.p, drafts.num_drafted,
                                      scale=self.threshold)


@flax.struct.dataclass(kw_only=True)
class Synthetic:
  """Each draft kept with a fixed probability `rate`, whatever p and q say
  (as vLLM's synthetic sampler), so random-weight models can be timed at a
  realistic acceptance rate.

  The verdicts form a text: row b's draft at sequence position n is kept
  iff one uniform draw u(text, b, n) < rate, whichever step, γ or policy
  judges it, so policies run with one key meet the same verdicts and
  differ only by their choices. A token tree's walk draws each tried child
  afresh. `specjax.loops.synthetic_text` gives a generation's text.

  Attributes:
    rate: [] float32 probability of keeping a draft.
    text: PRNG key of the text.
  """

  rate: jax.Array
  text: jax.Array
  lossless: ClassVar[bool] = False
  synthetic: ClassVar[bool] = True
  walks_trees: ClassVar[bool] = True

  @classmethod
  def create(cls, rate: float) -> "Synthetic":
    """Rate in [0, 1], on key 0's text until `with_text`."""
    if isinstance(rate, bool) or not 0.0 <= float(rate) <= 1.0:
      raise ValueError(f"synthetic_acceptance must be in [0, 1], got "
                       f"{rate}.")
    return cls(rate=np.float32(rate), text=sampling.host_key(0))

  def with_text(self, text: jax.Array) -> "Synthetic":
    return self.replace(text=text)

  def accepts(self, positions: jax.Array) -> jax.Array:
    """[B, K] bool: the verdicts on drafts at sequence `positions` [B, K]
    (int32) of rows 0..B-1."""
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None],
                            positions.shape)
    draw = lambda b, n: jax.random.uniform(
        jax.random.fold_in(jax.random.fold_in(self.text, b), n))
    return jax.vmap(jax.vmap(draw))(rows, positions) < self.rate

  def judge(self, key: jax.Array, drafts: Drafts
            ) -> tuple[jax.Array, jax.Array]:
    batch, gamma = drafts.tokens.shape
    if gamma == 0:
      return rejection.no_drafts(key, drafts.p)
    keep = self.accepts(drafts.positions[:, None] + jnp.arange(gamma)[None])
    keep &= rejection.proposed_mask(drafts.num_drafted, batch, gamma)
    num_accepted = rejection.leading_true(keep)
    return num_accepted, sampling.sample(
        key, rejection.at_position(drafts.p, num_accepted))

  def child(self, u: jax.Array, q_x: jax.Array, r_x: jax.Array
            ) -> jax.Array:
    del q_x, r_x  # the rate alone decides
    return u < self.rate


RULES = ("exact", "typical", "relaxed")


def from_name(rule: "str | Acceptance", *,
              synthetic_acceptance: float | None = None,
              typical_epsilon: float = 0.09, typical_delta: float = 0.3,
              acceptance_threshold: float = 0.5) -> Acceptance:
  """The rule named `rule` ("exact", "typical", "relaxed") with its
  settings (the others are ignored), or `Synthetic` at
  `synthetic_acceptance` in place of "exact"; a rule object passes
  through."""
  if synthetic_acceptance is not None:
    if rule != "exact":
      raise ValueError("synthetic_acceptance replaces verification; it "
                       f"cannot be combined with acceptance={rule!r}.")
    return Synthetic.create(synthetic_acceptance)
  if not isinstance(rule, str):
    return rule
  if rule == "exact":
    return Exact()
  if rule == "typical":
    return Typical.create(typical_epsilon, typical_delta)
  if rule == "relaxed":
    return Relaxed.create(acceptance_threshold)
  raise ValueError(f"acceptance must be 'exact' or one of {RULES[1:]}, or "
                   f"an Acceptance, got {rule!r}.")
