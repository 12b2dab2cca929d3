"""Structured output: a regex or JSON schema as static device tables.

Shape letters (`specjax.shapes`): V vocabulary size, Q automaton states
(padded), A token classes (padded), Y end-of-sequence ids; `...` any
leading axes (batch rows, draft positions).

A generation is one compiled `lax.while_loop`, so the constraint has to run
in the graph: `compile_grammar` turns a regex (or a JSON schema, through
the regex that outlines-core derives from it) into a token-level finite
automaton held in padded device tables, and `allowed`, `mask_logits`,
`advance`, `forced` and `forced_chain` are pure `jnp` functions of an int32
automaton state. A drafted token advances a speculative state and a
rejection rolls it back as it rolls back a cache: the caller keeps one state
per position.

Library: outlines-core (the `structured` extra, imported at first use),
whose `Index` is a token-level DFA over a `Vocabulary`: a finite automaton
is exactly what can become device tables, computed once on the host.
xgrammar and llguidance are more general (context-free grammars) but
compute each token's mask on the host, a round trip per token that a
compiled loop cannot make. The price: only what a regex can say (no
unbounded nesting).

Compressed form. A dense [Q, V] table is too big at V = 152k, but tokens
fall into few classes that every state treats alike. `Grammar` holds
`token_class: [V] int32` and `transitions: [Q, A] int32` (next state, -1 =
not allowed), so the mask of a state is
`transitions[state][token_class] >= 0`. Classes are found on the host by
hashing each token's (state, next state) pairs, checked exactly, with
partition refinement as the fallback on a hash collision. Q and A are
padded to powers of two, at least 16 (`_bucket`), so that grammars of
similar size share one compiled program. Table sizes for a real schema:
docs/controls.md, "Structured output".

States are renumbered: the initial state is 0 (`START`), -1 is dead (an
invalid token was taken; it stays -1 and allows nothing). Only states that
are reachable from the start and from which an accepting state is reachable
are kept, and a transition into any other state is dropped, so a generation
that follows `allowed` can always still finish. EOS ids are allowed exactly
in accepting (`final`) states, where they loop back to the same state, as
outlines-core's EOS does; special tokens other than EOS are never allowed.

A known limit of outlines-core 0.2.14 (fixed upstream, unreleased): a token
that leaves an accepting state for a non-accepting one is left out of its
index (with `[0-9]+(\\.[0-9]+)?` after "1", the token "." is refused while
".5" is allowed), so some strings of the language can only be spelled with
other tokenizations. What is allowed always matches.
"""

from __future__ import annotations

import collections
import functools
import json
from typing import Any, Mapping, Sequence, TYPE_CHECKING
import weakref

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import _optional

if TYPE_CHECKING:
  import outlines_core


__all__ = ["Grammar", "START", "accepts", "advance", "allowed",
           "compile_grammar", "forced", "forced_chain", "mask_logits",
           "vocabulary"]

# The initial state of every compiled grammar.
START = 0
# The setup.cfg extra that installs outlines-core.
_EXTRA = "structured"
# Smallest padded sizes: tiny grammars share one program.
_MIN_STATES = 16
_MIN_CLASSES = 16


@flax.struct.dataclass(kw_only=True)
class Grammar:
  """A token-level automaton as padded device tables (see module docstring).

  Leaves are numpy arrays, moved to the device by the jitted call that
  takes the grammar; only shapes (V, Q, A, Y) are compiled in, so every
  grammar with the same padded sizes reuses one program.

  Attributes:
    token_class: [V] int32 class of each token id.
    transitions: [Q, A] int32 next state per state and class, -1 where the
      class is not allowed (and in every padding row and column).
    forced_token: [Q] int32 the token to jump forward with (`forced`), -1
      where the state forces nothing.
    final: [Q] bool accepting states, where the EOS ids are allowed.
    live: [Q] bool real states (False for padding rows).
    eos_ids: [Y] int32 end-of-sequence ids.
  """

  token_class: np.ndarray
  transitions: np.ndarray
  forced_token: np.ndarray
  final: np.ndarray
  live: np.ndarray
  eos_ids: np.ndarray

  @property
  def vocab_size(self) -> int:
    return self.token_class.shape[-1]

  def summary(self) -> str:
    """Real and padded sizes, on the host."""
    states = int(np.sum(np.asarray(self.live)))
    classes = np.unique(np.asarray(self.token_class)).size
    q, a = self.transitions.shape
    return (f"Grammar({states} states, {classes} token classes; tables "
            f"[{q}, {a}] over V = {self.vocab_size})")


# ---------------------------------------------------------------- vocabulary

# Tokenizer -> {eos ids: Vocabulary}; building one costs ~0.5 s at V = 152k.
_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _eos_tuple(tokenizer, eos_ids: Sequence[int] | None) -> tuple[int, ...]:
  ids = tuple(dict.fromkeys(int(i) for i in (
      tokenizer.eos_ids if eos_ids is None else eos_ids)))
  if not ids:
    raise ValueError("A grammar needs at least one EOS id (none given and "
                     "the tokenizer declares none).")
  return ids


def vocabulary(tokenizer: Any,
               eos_ids: Sequence[int] | None = None
               ) -> outlines_core.Vocabulary:
  """An outlines-core `Vocabulary` of the bytes each token decodes to.

  Keys are bytes (outlines-core 0.2.14 accepts str or bytes keys and
  matches the regex on their UTF-8 / raw bytes), so byte-level tokens that
  split a character are matched byte by byte. Special tokens, every EOS
  id, the unknown token and tokens of no bytes are left out; the first
  EOS id is the vocabulary's `eos_token_id` (`compile_grammar` allows all
  of them).
  Cached per tokenizer and EOS ids.

  Args:
    tokenizer: a specjax tokenizer.
    eos_ids: end-of-sequence ids; default `tokenizer.eos_ids`.
  """
  eos = _eos_tuple(tokenizer, eos_ids)
  cached = _VOCABULARIES.setdefault(tokenizer, {})
  if eos not in cached:
    # Special tokens spell b"" (`Tokenizer.token_bytes`).
    skip = set(eos)
    backend = getattr(tokenizer, "backend", None)
    unk = getattr(getattr(backend, "model", None), "unk_token", None)
    if unk is not None and backend.token_to_id(unk) is not None:
      skip.add(backend.token_to_id(unk))
    spelled = collections.defaultdict(list)
    for i, b in enumerate(tokenizer.token_bytes()):
      if b and i not in skip:
        spelled[b].append(i)
    outlines = _optional.require("outlines_core", _EXTRA)
    cached[eos] = outlines.Vocabulary(eos[0], dict(spelled))
  return cached[eos]


# ------------------------------------------------------------------ compile


def _bucket(n: int, minimum: int) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def _pattern(regex: str | None, json_schema: Any) -> tuple[str, str]:
  """(regex, what it came from) after checking the arguments."""
  if (regex is None) == (json_schema is None):
    raise ValueError("Give exactly one of regex= and json_schema=.")
  if regex is not None:
    if not isinstance(regex, str):
      raise ValueError(f"regex must be a string, got {type(regex).__name__}.")
    return regex, f"regex {regex!r}"
  schema = json_schema
  if isinstance(schema, (str, bytes)):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise ValueError(f"json_schema is not valid JSON: {e}.") from e
  if not isinstance(schema, Mapping):
    raise ValueError("json_schema must be a JSON object (a dict or its JSON "
                     f"text), got {type(schema).__name__}.")
  text = json.dumps(schema)
  schemas = _optional.require("outlines_core.json_schema", _EXTRA)
  try:
    pattern = schemas.build_regex_from_schema(text)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"outlines-core cannot turn this JSON schema into a "
                     f"regex: {e}".rstrip()) from e
  return pattern, "the JSON schema's regex"


def _explore(index: outlines_core.Index, eos_ids: Sequence[int], what: str,
             max_states: int) -> tuple[list[int], list[np.ndarray],
                                       list[np.ndarray]]:
  """Walks outlines-core's index from its start, breadth first.

  Queried state by state (`get_allowed_tokens`, `get_next_state`):
  `get_transitions` builds one Python dict entry per (state, token), GBs
  for a large schema. EOS ids are left out (see `_tables`).

  Returns:
    The reachable outlines-core states (the start first), and per state
    the allowed token ids [k] and their next states [k], as int64 indices
    into that list.
  """
  order = [index.get_initial_state()]
  number = np.full(order[0] + 1, -1, np.int64)  # outlines-core id -> index
  number[order[0]] = 0
  tokens, targets = [], []
  for q in order:  # grows while iterating: breadth first
    ids = index.get_allowed_tokens(q) or []
    if index.is_final_state(q):  # the vocabulary's EOS has no next state
      for eos in eos_ids:
        if eos in ids:
          ids.remove(eos)
    step = functools.partial(index.get_next_state, q)
    nxt = np.fromiter(map(step, ids), np.int64, len(ids))
    ids = np.asarray(ids, np.int64)
    keep = ~np.isin(ids, eos_ids)  # EOS ids that are also plain tokens
    ids, nxt = ids[keep], nxt[keep]
    if nxt.size and nxt.max() >= number.size:
      number = np.pad(number, (0, 2 * int(nxt.max()) - number.size),
                      constant_values=-1)
    new = np.unique(nxt[number[nxt] < 0])
    number[new] = np.arange(len(order), len(order) + new.size)
    order += new.tolist()
    tokens.append(ids)
    targets.append(number[nxt])
    if len(order) > 2 * max_states:
      raise ValueError(f"The automaton of {what} has more than "
                       f"{2 * max_states} states, max_states={max_states}.")
  return order, tokens, targets


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer: a bijective scramble of uint64 values."""
  x = x ^ (x >> np.uint64(30))
  x = x * np.uint64(0xBF58476D1CE4E5B9)
  x = x ^ (x >> np.uint64(27))
  x = x * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _classes_hashed(rows: Sequence[tuple[np.ndarray, np.ndarray]],
                    vocab_size: int) -> np.ndarray:
  """[V] int64 labels, equal for tokens that every state treats alike, with
  high probability: a 64-bit hash of each token's (state, next state)
  transitions, updated in O(k) a state (no sort)."""
  signature = np.zeros(vocab_size, np.uint64)
  for s, (ids, nxt) in enumerate(rows):
    edge = _mix((np.uint64(s) << np.uint64(32)) + (nxt + 1).astype(np.uint64))
    signature[ids] = _mix(signature[ids] ^ edge)
  return signature.view(np.int64)


def _classes_exact(rows: Sequence[tuple[np.ndarray, np.ndarray]],
                   vocab_size: int) -> np.ndarray:
  """[V] int64 labels by partition refinement: state by state, tokens keep
  sharing a label while they share one and go to the same next state."""
  labels = np.zeros(vocab_size, np.int64)
  fresh = 1
  for ids, nxt in rows:
    if ids.size:
      key = labels[ids] * len(rows) + nxt
      unique, inverse = np.unique(key, return_inverse=True)
      labels[ids] = fresh + inverse.reshape(-1)
      fresh += unique.size
  return labels


def _class_table(rows: Sequence[tuple[np.ndarray, np.ndarray]],
                 labels: np.ndarray, eos_ids: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | None:
  """Classes from labels and the [Q_real, A_real] table, or None where a
  class holds tokens that some state treats differently."""
  is_eos = np.zeros(labels.size, bool)
  is_eos[eos_ids] = True
  _, first, inverse = np.unique(labels[~is_eos], return_index=True,
                                return_inverse=True)
  # Canonical numbering, whatever the labels: by each class's first token.
  rank = np.argsort(np.argsort(first))
  token_class = np.empty(labels.size, np.int64)
  token_class[~is_eos] = rank[inverse.reshape(-1)]
  token_class[is_eos] = inverse.max() + 1 if inverse.size else 0
  num_classes = int(token_class.max()) + 1
  sizes = np.bincount(token_class, minlength=num_classes)
  table = np.full((len(rows), num_classes), -1, np.int64)
  for s, (ids, nxt) in enumerate(rows):
    cls = token_class[ids]
    table[s, cls] = nxt
    # Exact check: one next state per class, and no class partly allowed.
    if (not np.array_equal(table[s, cls], nxt)
        or sizes[table[s] >= 0].sum() != ids.size):
      return None
  return token_class, table


# A state with more allowed tokens than this forces no text (`_forced`).
_MAX_FORCED_CHOICES = 256


def _forced(rows: Sequence[tuple[np.ndarray, np.ndarray]],
            final: np.ndarray, eos_ids: Sequence[int],
            token_bytes: Sequence[bytes] | None) -> np.ndarray:
  """[Q_real] int32 the token to jump forward with in each state, -1 for
  none: the only allowed token, or, with the vocabulary's bytes, the
  longest allowed token when every allowed token spells a prefix of it
  (the grammar forces that text, e.g. a JSON key, whichever way it is
  split into tokens). An accepting state forces its EOS when that is the
  one allowed token, else nothing."""
  out = np.full(len(rows), -1, np.int64)
  for q, (ids, _) in enumerate(rows):
    if final[q]:
      if not ids.size and len(eos_ids) == 1:
        out[q] = eos_ids[0]
      continue
    if not ids.size or ids.size > _MAX_FORCED_CHOICES:
      continue
    if ids.size == 1:
      out[q] = ids[0]
    elif token_bytes is not None:
      spelled = [token_bytes[i] for i in ids.tolist()]
      longest = int(np.argmax([len(b) for b in spelled]))
      if all(spelled[longest].startswith(b) for b in spelled):
        out[q] = ids[longest]
  return out


def _tables(index: outlines_core.Index, vocab_size: int,
            eos_ids: tuple[int, ...], what: str, max_states: int,
            max_classes: int,
            token_bytes: Sequence[bytes] | None = None) -> Grammar:
  """The compressed, padded tables of an outlines-core index.

  Only states reachable from the start that can reach an accepting state
  are kept, renumbered breadth first (the start is 0). EOS ids form one
  class, allowed in accepting states and looping there.
  """
  eos_array = np.asarray(eos_ids, np.int64)
  if eos_array.min() < 0 or eos_array.max() >= vocab_size:
    raise ValueError(f"EOS ids {list(eos_ids)} must lie in [0, {vocab_size}).")
  order, tokens, targets = _explore(index, eos_ids, what, max_states)
  is_final = np.asarray([index.is_final_state(q) for q in order], bool)

  # Co-reachability: which states reach an accepting one.
  pred = collections.defaultdict(set)
  for q, t in enumerate(targets):
    for r in np.unique(t).tolist():
      pred[r].add(q)
  stack = list(np.flatnonzero(is_final))
  good = np.zeros(len(order), bool)
  good[stack] = True
  while stack:
    for p in pred[stack.pop()]:
      if not good[p]:
        good[p] = True
        stack.append(p)
  if not good[0]:
    raise ValueError(f"No string matching {what} can be spelled with this "
                     "vocabulary.")
  num_states = int(good.sum())
  if num_states > max_states:
    raise ValueError(f"The automaton of {what} has {num_states} states, "
                     f"more than max_states={max_states}.")
  rename = np.where(good, np.cumsum(good) - 1, -1)  # start stays 0
  rows = []  # per kept state: allowed token ids [k], next states [k]
  for q in np.flatnonzero(good):
    ids, nxt = tokens[q], rename[targets[q]]
    keep = nxt >= 0
    if ids.size and ids.max() >= vocab_size:
      raise ValueError(f"Token id {ids.max()} is outside vocab_size="
                       f"{vocab_size}.")
    rows.append((ids[keep], nxt[keep]))
  final = is_final[good]

  built = _class_table(rows, _classes_hashed(rows, vocab_size), eos_array)
  if built is None:  # a 64-bit hash collision
    built = _class_table(rows, _classes_exact(rows, vocab_size), eos_array)
  token_class, table = built
  num_classes = table.shape[1]
  if num_classes > max_classes:
    raise ValueError(f"The automaton of {what} splits the vocabulary into "
                     f"{num_classes} token classes, more than "
                     f"max_classes={max_classes}.")
  eos_class = token_class[eos_array[0]]
  table[final, eos_class] = np.flatnonzero(final)

  forced_token = _forced(rows, final, eos_ids, token_bytes)

  q_pad = _bucket(num_states, _MIN_STATES)
  a_pad = _bucket(num_classes, _MIN_CLASSES)
  padded = np.full((q_pad, a_pad), -1, np.int32)
  padded[:num_states, :num_classes] = table
  return Grammar(
      token_class=token_class.astype(np.int32), transitions=padded,
      forced_token=np.pad(forced_token, (0, q_pad - num_states),
                          constant_values=-1).astype(np.int32),
      final=np.pad(final, (0, q_pad - num_states)),
      live=np.arange(q_pad) < num_states,
      eos_ids=np.asarray(eos_ids, np.int32))


def compile_grammar(source: Any | outlines_core.Vocabulary,
                    *, regex: str | None = None,
                    json_schema: Mapping[str, Any] | str | None = None,
                    eos_ids: Sequence[int] | None = None,
                    vocab_size: int | None = None,
                    max_states: int = 4096,
                    max_classes: int = 4096) -> Grammar:
  """Compiles a regex or a JSON schema into device tables.

  Args:
    source: a specjax `Tokenizer`, or an outlines-core `Vocabulary` (from
      `vocabulary`, to share one between grammars; `vocab_size` is then
      required).
    regex: a pattern the whole output must match (Rust `regex` syntax, as
      outlines-core compiles it: no look-around, no back-references).
    json_schema: a JSON schema, a dict or its JSON text; the output is
      JSON text that satisfies it (outlines-core's regex of it, compact
      whitespace).
    eos_ids: end-of-sequence ids, allowed exactly in accepting states;
      default the tokenizer's (or the vocabulary's one EOS id).
    vocab_size: V, the width of the model's logits (may exceed the
      tokenizer's; the extra ids are never allowed); default the
      tokenizer's vocabulary size.
    max_states: the most automaton states accepted.
    max_classes: the most token classes accepted.

  Returns:
    The `Grammar`; its start state is `START`.

  Raises:
    ValueError: neither or both of `regex` and `json_schema`; a regex
      outlines-core cannot compile or that no token sequence spells; a
      schema that is not a JSON object or that outlines-core does not
      support; an automaton over `max_states` or `max_classes`.
  """
  outlines = _optional.require("outlines_core", _EXTRA)
  pattern, what = _pattern(regex, json_schema)
  if isinstance(source, outlines.Vocabulary):
    if vocab_size is None:
      raise ValueError("vocab_size is required with an outlines-core "
                       "Vocabulary.")
    vocab, token_bytes = source, None
    eos = (source.get_eos_token_id(),) if eos_ids is None else tuple(
        int(i) for i in eos_ids)
    if source.get_eos_token_id() not in eos:
      raise ValueError(f"eos_ids {list(eos)} must hold the vocabulary's EOS "
                       f"id {source.get_eos_token_id()}.")
  else:
    eos = _eos_tuple(source, eos_ids)
    vocab, token_bytes = vocabulary(source, eos), source.token_bytes()
    vocab_size = source.vocab_size if vocab_size is None else vocab_size
  try:
    index = outlines.Index(pattern, vocab)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"outlines-core cannot build an automaton for {what}: "
                     f"{e}".rstrip()) from e
  return _tables(index, int(vocab_size), eos, what, max_states, max_classes,
                 token_bytes)


# ---------------------------------------------------------- device functions


def _row(grammar: Grammar, state: jax.Array) -> jax.Array:
  """[...] states -> [..., A] next states per class, -1 for a dead state."""
  state = jnp.asarray(state, jnp.int32)
  row = jnp.asarray(grammar.transitions)[jnp.maximum(state, 0)]
  return jnp.where((state >= 0)[..., None], row, -1)


def allowed(grammar: Grammar, state: jax.Array) -> jax.Array:
  """[...] int32 states -> [..., V] bool tokens allowed next (none in the
  dead state -1)."""
  ok = _row(grammar, state) >= 0  # [..., A]
  # [..., A] -> [..., V]
  return jnp.take(ok, jnp.asarray(grammar.token_class), axis=-1)


def mask_logits(grammar: Grammar, state: jax.Array,
                logits: jax.Array) -> jax.Array:
  """[..., V] logits with -inf where the token is not allowed in `state`
  [...] (every token in the dead state: the caller must not sample
  there)."""
  if logits.shape[-1] != grammar.vocab_size:
    raise ValueError(f"logits have {logits.shape[-1]} entries, the grammar "
                     f"V = {grammar.vocab_size}.")
  return jnp.where(allowed(grammar, state), logits,
                   jnp.asarray(-jnp.inf, logits.dtype))


def advance(grammar: Grammar, state: jax.Array,
            token: jax.Array) -> jax.Array:
  """The state after `token`: [...] int32 states and tokens (broadcast)
  -> [...] int32, -1 (dead) for a token not allowed, an id outside
  [0, V), or a dead state."""
  state = jnp.asarray(state, jnp.int32)
  token = jnp.asarray(token, jnp.int32)
  vocab = grammar.vocab_size
  cls = jnp.asarray(grammar.token_class)[jnp.clip(token, 0, vocab - 1)]
  nxt = jnp.asarray(grammar.transitions)[jnp.maximum(state, 0), cls]
  return jnp.where((state >= 0) & (token >= 0) & (token < vocab), nxt, -1)


def accepts(grammar: Grammar, state: jax.Array) -> jax.Array:
  """[...] int32 states -> [...] bool: accepting (EOS allowed)."""
  state = jnp.asarray(state, jnp.int32)
  return (state >= 0) & jnp.asarray(grammar.final)[jnp.maximum(state, 0)]


def forced(grammar: Grammar, state: jax.Array) -> jax.Array:
  """[...] int32 states -> [...] int32 the token to jump forward with,
  else -1 (and in the dead state): the one allowed token, or, where the
  grammar forces a text that several tokens spell prefixes of (a JSON key
  after its quote: "name", "na", "n" ...), the longest of them, the text
  in one token. Any allowed choice keeps the output exact under
  verification; the longest is how BPE tokenizers usually spell it."""
  state = jnp.asarray(state, jnp.int32)
  token = jnp.asarray(grammar.forced_token)[jnp.maximum(state, 0)]
  return jnp.where(state >= 0, token, -1)


def forced_chain(grammar: Grammar, state: jax.Array,
                 length: int) -> tuple[jax.Array, jax.Array]:
  """Follows forced tokens from `state` for up to `length` steps.

  The chain stops at the first state with a choice of text, or after an
  EOS. These tokens can be drafted for free: the grammar leaves no other
  text.

  Args:
    grammar: the tables.
    state: [...] int32 start states.
    length: static number of steps.

  Returns:
    tokens: [..., length] int32 the forced tokens, -1 past `count`.
    count: [...] int32 how many are forced.
  """
  state = jnp.asarray(state, jnp.int32)

  def step(carry, _):
    q, going = carry
    token = jnp.where(going, forced(grammar, q), -1)  # [...]
    going = token >= 0
    is_eos = jnp.any(token[..., None] == grammar.eos_ids, axis=-1)
    return (advance(grammar, q, token), going & ~is_eos), token

  going = jnp.ones(state.shape, bool)
  _, tokens = jax.lax.scan(step, (state, going), None, length=length)
  tokens = jnp.moveaxis(tokens, 0, -1)  # [length, ...] -> [..., length]
  return tokens, jnp.sum(tokens >= 0, axis=-1, dtype=jnp.int32)
