"""Generation controls that depend on the text so far: penalties, logit bias.

Shape letters (`specjax.shapes`): B batch, V vocab, C tokens committed in
one step, G = γ draft tokens, T tree nodes; `...` the positions a
distribution is computed at ([B] for one token, [B, G+1] for a verified
chain, [B, T+1] for a tree).

`Controls` holds the settings (traced, so changing a value never
recompiles; a control left at None is not in the program at all) and the
state they read, per row and per position:

- `counts` [..., V] int32, how often each token was generated so far;
- `prompt` [B, V] bool, the tokens of the prompt (the repetition penalty
  counts them, as Hugging Face's does; the OpenAI penalties count only
  generated tokens, as the OpenAI API does).

`apply` turns raw logits into processed logits, in this order:

1. repetition penalty ρ (Hugging Face's `RepetitionPenaltyLogitsProcessor`):
   a token seen in the prompt or the output has its logit divided by ρ when
   positive, multiplied by ρ when negative;
2. presence and frequency penalties (the OpenAI definitions): logit -
   count · frequency - [count > 0] · presence;
3. `logit_bias`: a dense [V] vector added to the logits (the OpenAI
   `logit_bias` map);
4. a grammar's mask (`specjax.grammar`), where one is set.

Temperature, top-k, top-p and min-p then apply (`specjax.sampling`).

Exactness under speculation comes from where the state is read: the
distribution at a draft position uses the history *including the drafted
prefix up to that position*, for the draft's q and the target's p alike
(`along_chain`, `along_tree`, `advance` inside a drafting loop). Rejection
sampling then compares the same processed distributions a plain
autoregressive generation would sample from, position by position.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import grammar as grammar_lib
from specjax import stops as stops_lib

__all__ = ["Controls", "RANGES", "resolve", "setting"]

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
  label = label or name
  low, high, open_low = RANGES[name]
  return _scalar(label, value, low, high, open_low=open_low)


def _scalar(name: str, value: float | None, low: float, high: float,
            *, open_low: bool = False) -> np.ndarray | None:
  """A validated float setting as a numpy scalar (None stays None)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float,
                                                        np.number)):
    raise ValueError(f"{name} must be a number, got {value!r}.")
  value = float(value)
  ok = (low < value if open_low else low <= value) and value <= high
  if not ok:  # also rejects NaN
    left = "(" if open_low else "["
    raise ValueError(f"{name} must be in {left}{low}, {high}], got {value}.")
  return np.float32(value)


def _bias_vector(logit_bias: Mapping[int, float] | None,
                 vocab_size: int) -> np.ndarray | None:
  """{token id: bias} -> [V] float32 (None stays None)."""
  if logit_bias is None:
    return None
  if not isinstance(logit_bias, Mapping):
    raise ValueError("logit_bias must be a mapping {token_id: bias}, got "
                     f"{type(logit_bias).__name__}.")
  vector = np.zeros((vocab_size,), np.float32)
  for token, bias in logit_bias.items():
    token = int(token)  # OpenAI's JSON keys are strings of ids
    if not 0 <= token < vocab_size:
      raise ValueError(f"logit_bias token {token} is outside the "
                       f"vocabulary [0, {vocab_size}).")
    vector[token] = setting("logit_bias", bias, f"logit_bias[{token}]")
  return vector


def _lead(x: jax.Array, ndim: int) -> jax.Array:
  """x [A..., rest] with axes inserted after its leading ones so that it
  has `ndim` axes: state of fewer positions broadcast over more."""
  extra = ndim - x.ndim
  if extra < 0:
    raise ValueError(f"Controls state of rank {x.ndim} is deeper than "
                     f"logits of rank {ndim}.")
  return x.reshape(x.shape[:-1] + (1,) * extra + x.shape[-1:])


@flax.struct.dataclass(kw_only=True)
class Controls:
  """History-dependent logit processing and the history it reads.

  Settings (traced; None: off, and absent from the program):
    repetition_penalty: [] float32 ρ > 0 (1 changes nothing).
    presence_penalty: [] float32 in [-2, 2].
    frequency_penalty: [] float32 in [-2, 2].
    logit_bias: [V] float32 added to the logits.
    grammar: a `specjax.grammar.Grammar`, or None.

  State (None until `start`):
    counts: [..., V] int32 generated-token counts (drafted prefix
      included at a draft position).
    prompt: [B, V] bool tokens of each row's prompt (for ρ only; None
      without ρ).
    state: [...] int32 the grammar automaton's state (None without a
      grammar).
  """

  repetition_penalty: jax.Array | None = None
  presence_penalty: jax.Array | None = None
  frequency_penalty: jax.Array | None = None
  logit_bias: jax.Array | None = None
  grammar: Any = None
  counts: jax.Array | None = None
  prompt: jax.Array | None = None
  state: jax.Array | None = None

  @classmethod
  def create(cls, vocab_size: int, *, repetition_penalty: float | None = None,
             presence_penalty: float | None = None,
             frequency_penalty: float | None = None,
             logit_bias: Mapping[int, float] | None = None,
             grammar: Any = None) -> "Controls | None":
    """Validated settings; None when every control is off.

    Raises:
      ValueError: a penalty outside its range, or a bias for a token
        outside the vocabulary.
    """
    out = cls(
        repetition_penalty=setting("repetition_penalty", repetition_penalty),
        presence_penalty=setting("presence_penalty", presence_penalty),
        frequency_penalty=setting("frequency_penalty", frequency_penalty),
        logit_bias=_bias_vector(logit_bias, vocab_size), grammar=grammar)
    return out if out.active else None

  @property
  def active(self) -> bool:
    """Whether any control is set (static)."""
    return any(x is not None for x in (
        self.repetition_penalty, self.presence_penalty,
        self.frequency_penalty, self.logit_bias, self.grammar))

  @property
  def _counting(self) -> bool:
    return any(x is not None for x in (
        self.repetition_penalty, self.presence_penalty,
        self.frequency_penalty))

  # ----------------------------------------------------------------- state

  def start(self, prompts: jax.Array, lengths: jax.Array,
            vocab_size: int) -> "Controls":
    """The state before the first generated token.

    Args:
      prompts: [B, P] int32 right-padded prompts.
      lengths: [B] int32 prompt lengths.
      vocab_size: V.
    """
    batch = prompts.shape[0]
    prompt = counts = state = None
    if self._counting:
      counts = jnp.zeros((batch, vocab_size), jnp.int32)
    if self.repetition_penalty is not None:
      real = jnp.arange(prompts.shape[1])[None] < lengths[:, None]
      rows = jnp.broadcast_to(jnp.arange(batch)[:, None], prompts.shape)
      prompt = jnp.zeros((batch, vocab_size), bool).at[
          rows, jnp.where(real, prompts, vocab_size)].set(True, mode="drop")
    if self.grammar is not None:
      state = jnp.zeros((batch,), jnp.int32)
    return self.replace(counts=counts, prompt=prompt, state=state)

  def advance(self, tokens: jax.Array, take: jax.Array | None = None
              ) -> "Controls":
    """The state after one more token per row.

    Args:
      tokens: [B] int32.
      take: [B] bool rows that take it (default all).
    """
    counts, state = self.counts, self.state
    if counts is not None:
      hot = jax.nn.one_hot(tokens, counts.shape[-1], dtype=jnp.int32)
      if take is not None:
        hot = hot * take[:, None]
      counts = counts + hot
    if state is not None:
      moved = grammar_lib.advance(self.grammar, state, tokens)
      state = moved if take is None else jnp.where(take, moved, state)
    return self.replace(counts=counts, state=state)

  def advance_many(self, tokens: jax.Array, num_new: jax.Array
                   ) -> "Controls":
    """The state after each row's first num_new [B] of tokens [B, C]."""
    out = self
    for i in range(tokens.shape[1]):
      out = out.advance(tokens[:, i], i < num_new)
    return out

  def along_chain(self, tokens: jax.Array) -> "Controls":
    """The state at each position of a verified chain: [B] -> [B, G+1],
    position i after drafts [B, G] tokens[:, :i]."""
    counts, state = self.counts, self.state
    if counts is not None:
      hot = jax.nn.one_hot(tokens, counts.shape[-1], dtype=jnp.int32)
      before = jnp.concatenate([jnp.zeros_like(hot[:, :1]),
                                jnp.cumsum(hot, axis=1)], 1)  # [B, G+1, V]
      counts = counts[:, None] + before
    if state is not None:
      states = [state]
      for i in range(tokens.shape[1]):
        states.append(grammar_lib.advance(self.grammar, states[-1],
                                          tokens[:, i]))
      state = jnp.stack(states, 1)
    return self.replace(counts=counts, state=state)

  def along_tree(self, tokens: jax.Array, parents: jax.Array,
                 ancestors: jax.Array) -> "Controls":
    """The state at the root and after each node of a token tree: [B] ->
    [B, T+1], node i's history its own ancestors and itself.

    Args:
      tokens: [B, T] int32 node tokens.
      parents: [B, T] int32 (-1 the root; topological order).
      ancestors: [B, T, T] bool, node j on the path root..i (i included).
    """
    counts, state = self.counts, self.state
    if counts is not None:
      hot = jax.nn.one_hot(tokens, counts.shape[-1], dtype=jnp.int32)
      path = jnp.einsum("bij,bjv->biv", ancestors.astype(jnp.int32), hot)
      counts = jnp.concatenate([counts[:, None], counts[:, None] + path], 1)
    if state is not None:
      rows = jnp.arange(tokens.shape[0])

      def body(i, states):  # states [B, T+1], the root at 0
        parent = states[rows, parents[:, i] + 1]
        return states.at[:, i + 1].set(
            grammar_lib.advance(self.grammar, parent, tokens[:, i]))

      states = jnp.broadcast_to(state[:, None],
                                (tokens.shape[0], tokens.shape[1] + 1))
      state = jax.lax.fori_loop(0, tokens.shape[1], body, states)
    return self.replace(counts=counts, state=state)

  # ------------------------------------------------------------ processing

  def apply(self, logits: jax.Array) -> jax.Array:
    """Processed logits [..., V] float32 (module docstring's order).

    The state's leading axes are the logits' leading axes, or fewer (a
    drafter that scores several positions from one history: its state is
    broadcast over the rest).
    """
    logits = logits.astype(jnp.float32)
    ndim = logits.ndim
    if self.counts is not None:
      counts = _lead(self.counts, ndim)
      if self.repetition_penalty is not None:
        seen = (counts > 0) | _lead(self.prompt, ndim)
        rho = self.repetition_penalty
        penalised = jnp.where(logits > 0, logits / rho, logits * rho)
        logits = jnp.where(seen, penalised, logits)
      if self.frequency_penalty is not None:
        logits = logits - counts.astype(jnp.float32) * self.frequency_penalty
      if self.presence_penalty is not None:
        logits = logits - (counts > 0).astype(jnp.float32) * (
            self.presence_penalty)
    if self.logit_bias is not None:
      logits = logits + self.logit_bias
    if self.state is not None:
      # A dead state (-1) follows a draft the grammar forbids: the target
      # rejects that draft, and the distributions after it are never used.
      allowed = (grammar_lib.allowed(self.grammar, self.state)
                 | (self.state < 0)[..., None])
      logits = jnp.where(_lead(allowed, ndim), logits, -jnp.inf)
    return logits


def _tokenizer_for(what: str, tokenizer: Any) -> Any:
  """`tokenizer`, or a clear error naming what needs it."""
  if tokenizer is None:
    raise ValueError(f"{what} needs the model's tokenizer: pass "
                     "tokenizer= (a specjax.tokenizer.Tokenizer), since "
                     "matching happens on the bytes tokens decode to.")
  return tokenizer


@functools.lru_cache(maxsize=16)
def _stop_strings(tokenizer: Any, stop: tuple[str, ...],
                  vocab_size: int) -> Any:
  return stops_lib.compile_stops(stop, tokenizer.token_bytes(),
                                 vocab_size=vocab_size)


@functools.lru_cache(maxsize=8)
def _grammar(tokenizer: Any, regex: str | None, schema: str | None,
             eos_ids: tuple[int, ...], vocab_size: int) -> Any:
  return grammar_lib.compile_grammar(tokenizer, regex=regex,
                                     json_schema=schema, eos_ids=eos_ids,
                                     vocab_size=vocab_size)


def resolve(vocab_size: int, *, tokenizer: Any = None, eos_id: Any = None,
            stop: Sequence[str] | None = None,
            repetition_penalty: float | None = None,
            presence_penalty: float | None = None,
            frequency_penalty: float | None = None,
            logit_bias: Mapping[int, float] | None = None,
            regex: str | None = None,
            json_schema: Mapping[str, Any] | str | None = None
            ) -> tuple["Controls | None", Any]:
  """The `Controls` and stop strings (`specjax.stops.StopStrings`) for the
  keywords of `generate` and `speculative_generate`; None for what is off.

  Stop tables and grammars are compiled once per (tokenizer, strings) and
  kept (an LRU cache): a repeated call compiles nothing on the host.

  Raises:
    ValueError: an invalid control, or stop strings or a grammar without a
      tokenizer (or a grammar without an EOS id).
  """
  stops = None
  if stop is not None:
    stop = stops_lib.validate(stop)
    if stop:
      stops = _stop_strings(_tokenizer_for("stop", tokenizer), stop,
                            vocab_size)
  grammar = None
  if regex is not None or json_schema is not None:
    if regex is not None and json_schema is not None:
      raise ValueError("Pass regex= or json_schema=, not both.")
    tokenizer = _tokenizer_for("regex= / json_schema=", tokenizer)
    if eos_id is None:
      raise ValueError("Structured output needs eos_id= (the grammar "
                       "allows it where the text is complete).")
    if json_schema is not None and not isinstance(json_schema, str):
      json_schema = json.dumps(json_schema, sort_keys=True)
    eos = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(
        int(i) for i in eos_id)
    grammar = _grammar(tokenizer, regex, json_schema, eos, vocab_size)
  return Controls.create(
      vocab_size, repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
      logit_bias=logit_bias, grammar=grammar), stops
