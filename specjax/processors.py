"""Logit processors: the generation controls, one small object each.

Shape letters (`specjax.shapes`): B batch, V vocab, G = γ draft tokens, T
tree nodes; `...` the positions a distribution is computed at ([B] for one
token, [B, G+1] for a verified chain, [B, T+1] for a tree).

A processor holds its settings (traced: changing one never recompiles) and
a `state`: the part of the history it reads, None until `start`. It knows
how its state moves by one token (`step`) and how it turns raw logits into
processed ones (`process`); `Processor` derives from those the state at
every position of a drafted chain or tree, which is what keeps speculation
exact: the distribution at a draft position reads the history *including
the drafted prefix up to it*, for the draft's q and the target's p alike.

Built in, applied in this order (`specjax.controls.resolve`):

1. `RepetitionPenalty` ρ (Hugging Face's): a token seen in the prompt or
   the output has its logit divided by ρ when positive, multiplied when
   negative;
2. `FrequencyPenalty`, `PresencePenalty` (the OpenAI definitions, output
   only): logit - count · frequency - [count > 0] · presence;
3. `LogitBias`: a dense [V] vector added (the OpenAI `logit_bias` map);
4. processors the caller passes (`SamplingConfig.processors`);
5. `GrammarMask` (`specjax.grammar`), last, so nothing lifts a masked
   token.

Temperature, top-k, top-p and min-p then apply (`specjax.sampling`). A new
processor is one subclass of `Processor` with `init`, `step` and `process`.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import grammar as grammar_lib

__all__ = ["FrequencyPenalty", "GrammarMask", "LogitBias",
           "PresencePenalty", "Processor", "RANGES", "RepetitionPenalty",
           "lead", "setting"]

# Each float setting's (low, high, low excluded): Hugging Face's ρ > 0,
# the OpenAI API's penalties and bias, min-p a probability ratio.
RANGES = {
    "repetition_penalty": (0.0, np.inf, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "logit_bias": (-100.0, 100.0, False),
    "min_p": (0.0, 1.0, False),
}


def setting(name: str, value: float | None,
            label: str | None = None) -> np.ndarray | None:
  """The float setting `name` (a key of `RANGES`) validated, as a numpy
  scalar (None stays None); errors name it `label` (default `name`)."""
  if value is None:
    return None
  label = label or name
  low, high, open_low = RANGES[name]
  if isinstance(value, bool) or not isinstance(value, (int, float,
                                                        np.number)):
    raise ValueError(f"{label} must be a number, got {value!r}.")
  value = float(value)
  ok = (low < value if open_low else low <= value) and value <= high
  if not ok:  # also rejects NaN
    left = "(" if open_low else "["
    raise ValueError(f"{label} must be in {left}{low}, {high}], got "
                     f"{value}.")
  return np.float32(value)


def lead(x: jax.Array, ndim: int) -> jax.Array:
  """x [A..., V] with axes inserted before V so that it has `ndim` axes:
  state of fewer positions broadcast over logits of more (a drafter that
  scores several positions from one history)."""
  extra = ndim - x.ndim
  if extra < 0:
    raise ValueError(f"Processor state of rank {x.ndim} is deeper than "
                     f"logits of rank {ndim}.")
  return x.reshape(x.shape[:-1] + (1,) * extra + x.shape[-1:])


def _where_rows(take: jax.Array, new: Any, old: Any) -> Any:
  """`new` in rows where take [B] holds, else `old` (pytrees of [B, ...])."""
  return jax.tree.map(
      lambda n, o: jnp.where(take.reshape(take.shape + (1,) * (n.ndim - 1)),
                             n, o), new, old)


@flax.struct.dataclass(kw_only=True)
class Processor:
  """A logit processor and the history it reads.

  Subclasses give `init`, `step` and `process`; they may override
  `along_chain` / `along_tree` with a cheaper equivalent.

  Attributes:
    state: a pytree of [B, ...] arrays (per position: [..., ...]), or None
      before `start` and for a processor that reads no history.
  """

  state: Any = None

  def init(self, prompts: jax.Array, lengths: jax.Array,
           vocab_size: int) -> Any:
    """The state before the first generated token, from prompts [B, P]
    int32 (right-padded) of lengths [B]."""
    del prompts, lengths, vocab_size
    return None

  def step(self, state: Any, tokens: jax.Array) -> Any:
    """The state after one more token [B] (or [...], as the state)."""
    del tokens
    return state

  def process(self, logits: jax.Array) -> jax.Array:
    """Processed logits [..., V] float32 from `state`'s positions (its
    leading axes are the logits', or fewer: `lead`)."""
    raise NotImplementedError

  # ------------------------------------------------ derived, shared by all

  def start(self, prompts: jax.Array, lengths: jax.Array,
            vocab_size: int) -> "Processor":
    return self.replace(state=self.init(prompts, lengths, vocab_size))

  def advance(self, tokens: jax.Array, take: jax.Array | None = None
              ) -> "Processor":
    """After one more token [B] in the rows where `take` [B] (default
    all)."""
    if self.state is None:
      return self
    new = self.step(self.state, tokens)
    return self.replace(state=new if take is None
                        else _where_rows(take, new, self.state))

  def along_chain(self, tokens: jax.Array) -> "Processor":
    """The state at each position of a verified chain: [B] -> [B, G+1],
    position i after drafts [B, G] tokens[:, :i]."""
    if self.state is None:
      return self
    states = [self.state]
    for i in range(tokens.shape[1]):
      states.append(self.step(states[-1], tokens[:, i]))
    return self.replace(
        state=jax.tree.map(lambda *s: jnp.stack(s, 1), *states))

  def along_tree(self, tokens: jax.Array, parents: jax.Array,
                 ancestors: jax.Array) -> "Processor":
    """The state at the root and after each node of a token tree: [B] ->
    [B, T+1], node i's history its ancestors and itself.

    Args:
      tokens: [B, T] int32 node tokens.
      parents: [B, T] int32 (-1 the root; topological order).
      ancestors: [B, T, T] bool, node j on the path root..i (i included).
    """
    del ancestors
    if self.state is None:
      return self
    batch, size = tokens.shape
    rows = jnp.arange(batch)

    def body(i, states):  # [B, T+1, ...], the root at 0
      parent = jax.tree.map(lambda s: s[rows, parents[:, i] + 1], states)
      child = self.step(parent, tokens[:, i])
      return jax.tree.map(lambda s, c: s.at[:, i + 1].set(c), states, child)

    states = jax.tree.map(
        lambda s: jnp.broadcast_to(s[:, None],
                                   (batch, size + 1) + s.shape[1:]),
        self.state)
    return self.replace(state=jax.lax.fori_loop(0, size, body, states))

  def apply(self, logits: jax.Array) -> jax.Array:
    return self.process(logits.astype(jnp.float32))


@flax.struct.dataclass(kw_only=True)
class _Counting(Processor):
  """A processor reading token counts: state [..., V] int32, how often each
  token occurred (the drafted prefix included at a draft position)."""

  def init(self, prompts, lengths, vocab_size):
    del lengths
    return jnp.zeros((prompts.shape[0], vocab_size), jnp.int32)

  def step(self, state, tokens):
    return state + jax.nn.one_hot(tokens, state.shape[-1], dtype=jnp.int32)

  def along_chain(self, tokens):
    hot = jax.nn.one_hot(tokens, self.state.shape[-1], dtype=jnp.int32)
    before = jnp.concatenate([jnp.zeros_like(hot[:, :1]),
                              jnp.cumsum(hot, axis=1)], 1)  # [B, G+1, V]
    return self.replace(state=self.state[:, None] + before)

  def along_tree(self, tokens, parents, ancestors):
    del parents
    hot = jax.nn.one_hot(tokens, self.state.shape[-1], dtype=jnp.int32)
    path = jnp.einsum("bij,bjv->biv", ancestors.astype(jnp.int32), hot)
    return self.replace(state=jnp.concatenate(
        [self.state[:, None], self.state[:, None] + path], 1))


@flax.struct.dataclass(kw_only=True)
class RepetitionPenalty(_Counting):
  """Hugging Face's `RepetitionPenaltyLogitsProcessor` over the prompt and
  the output; state: counts with the prompt's tokens included.

  Attributes:
    rho: [] float32 ρ > 0 (1 changes nothing).
  """

  rho: jax.Array

  def init(self, prompts, lengths, vocab_size):
    batch = prompts.shape[0]
    real = jnp.arange(prompts.shape[1])[None] < lengths[:, None]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], prompts.shape)
    return jnp.zeros((batch, vocab_size), jnp.int32).at[
        rows, jnp.where(real, prompts, vocab_size)].set(1, mode="drop")

  def process(self, logits):
    seen = lead(self.state, logits.ndim) > 0
    penalised = jnp.where(logits > 0, logits / self.rho, logits * self.rho)
    return jnp.where(seen, penalised, logits)


@flax.struct.dataclass(kw_only=True)
class FrequencyPenalty(_Counting):
  """The OpenAI frequency penalty: logit - count · penalty, over the
  output.

  Attributes:
    penalty: [] float32 in [-2, 2].
  """

  penalty: jax.Array

  def process(self, logits):
    counts = lead(self.state, logits.ndim)
    return logits - counts.astype(jnp.float32) * self.penalty


@flax.struct.dataclass(kw_only=True)
class PresencePenalty(_Counting):
  """The OpenAI presence penalty: logit - [count > 0] · penalty, over the
  output.

  Attributes:
    penalty: [] float32 in [-2, 2].
  """

  penalty: jax.Array

  def process(self, logits):
    seen = lead(self.state, logits.ndim) > 0
    return logits - seen.astype(jnp.float32) * self.penalty


@flax.struct.dataclass(kw_only=True)
class LogitBias(Processor):
  """A dense bias added to the logits (the OpenAI `logit_bias` map).

  Attributes:
    bias: [V] float32.
  """

  bias: jax.Array

  @classmethod
  def create(cls, logit_bias: Mapping[int, float],
             vocab_size: int) -> "LogitBias":
    """From {token id: bias in [-100, 100]} (ids may be JSON strings)."""
    if not isinstance(logit_bias, Mapping):
      raise ValueError("logit_bias must be a mapping {token_id: bias}, got "
                       f"{type(logit_bias).__name__}.")
    vector = np.zeros((vocab_size,), np.float32)
    for token, bias in logit_bias.items():
      token = int(token)
      if not 0 <= token < vocab_size:
        raise ValueError(f"logit_bias token {token} is outside the "
                         f"vocabulary [0, {vocab_size}).")
      vector[token] = setting("logit_bias", bias, f"logit_bias[{token}]")
    return cls(bias=vector)

  def process(self, logits):
    return logits + self.bias


@flax.struct.dataclass(kw_only=True)
class GrammarMask(Processor):
  """Masks the tokens a grammar forbids (`specjax.grammar`); state [...]
  int32, the automaton's state (-1 dead: after a draft the grammar
  forbids, which the target rejects, so the distributions after it are
  never used).

  Attributes:
    grammar: the compiled `specjax.grammar.Grammar`.
  """

  grammar: Any

  def init(self, prompts, lengths, vocab_size):
    del lengths, vocab_size
    return jnp.zeros((prompts.shape[0],), jnp.int32)

  def step(self, state, tokens):
    return grammar_lib.advance(self.grammar, state, tokens)

  def process(self, logits):
    allowed = (grammar_lib.allowed(self.grammar, self.state)
               | (self.state < 0)[..., None])
    return jnp.where(lead(allowed, logits.ndim), logits, -jnp.inf)
