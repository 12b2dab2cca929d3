"""Stop strings detected in the decoding loop, on token ids.

Shape letters (`specjax.shapes`): B batch, C tokens emitted per step, V
vocabulary size, Q automaton states.

A stop string is text (`stop=["\\n\\ndef ", "```"]`), but the loop only sees
ids, and one string has many tokenisations: inside one token, split over
several, across two steps, inside a token that holds text on both sides of
it. `compile_stops` builds, on the host, the byte-level Aho–Corasick automaton
of the stop strings' UTF-8 bytes and runs every token's bytes
(`Tokenizer.token_bytes`) through it from every state at once, giving one
table: `transitions[q, v]`, the state after reading token v in state q, or
`STOPPED` when a stop string completes within or at the end of token v. In
the loop, `advance` is then one gather per emitted token, whatever the
tokenisation. The table's first axis is padded to a power of two (at least
8), so stop lists of similar total length share one compiled program. It is
Q·V int16: at V = 152k, 2.4 MB at Q = 8, 78 MB at the 256-byte cap
(Q = 256).

Limits:

- Matching is on the bytes the tokens decode to: the text
  `decode(ids, skip_special_tokens=True)` gives. Special (control) tokens
  decode to nothing, so they never match and a match may run across one.
  A stop string holding U+FFFD matches only that character, never bytes
  that failed to decode.
- The prompt is not part of the match: a row's state starts at `START` at
  its first generated token, so a stop string that begins in the prompt is
  not found.
- A match is reported at the token that completes it, and the output keeps
  that whole token: text after the stop string in the same token stays in
  the ids; `truncate_text` cuts the decoded text where the stop string ends.
- The stop strings' total UTF-8 length is at most `MAX_STOP_BYTES`.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# The state every row starts from, and the state of a row whose stop string
# has completed (it stays there).
START = 0
STOPPED = -1

# Cap on the stop strings' total UTF-8 length, which bounds Q (<= 256).
MAX_STOP_BYTES = 256


@flax.struct.dataclass(kw_only=True)
class StopStrings:
  """The compiled stop strings of one request.

  `compile_stops` returns numpy leaves: a jitted call transfers them at
  every call, so `jax.device_put` the object once if the loop runs often.

  Attributes:
    transitions: [Q, V] int16; the state after reading token v in state q,
      `STOPPED` when a stop string completes within or at the end of the
      token. Ids past the tokenizer's vocabulary leave the state unchanged.
  """

  transitions: jax.Array

  @property
  def num_states(self) -> int:
    """Q, the padded number of states."""
    return self.transitions.shape[0]

  @property
  def vocab_size(self) -> int:
    """V."""
    return self.transitions.shape[1]


def validate(stop: Sequence[str]) -> tuple[str, ...]:
  """Checks a user's stop list; returns it as a tuple.

  Raises:
    ValueError: `stop` is not a list or tuple of non-empty strings, or the
      strings' total UTF-8 length is over `MAX_STOP_BYTES`.
  """
  if isinstance(stop, (str, bytes)):
    raise ValueError(
        f"stop must be a list of strings, got {type(stop).__name__}; "
        f"write stop=[{stop!r}].")
  if not isinstance(stop, (list, tuple)):
    raise ValueError(
        f"stop must be a list of strings, got {type(stop).__name__}.")
  for s in stop:
    if not isinstance(s, str) or not s:
      raise ValueError(f"stop strings must be non-empty strings, got {s!r} "
                       f"in stop={list(stop)!r}.")
    try:
      s.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"stop string {s!r} is not valid text ({e}).") from e
  total = sum(len(s.encode("utf-8")) for s in stop)
  if total > MAX_STOP_BYTES:
    raise ValueError(
        f"{len(stop)} stop strings of {total} UTF-8 bytes in all; at most "
        f"{MAX_STOP_BYTES} are supported (the table grows with the total).")
  return tuple(stop)


def compile_stops(stop: Sequence[str], token_bytes: Sequence[bytes], *,
                  vocab_size: int | None = None) -> StopStrings:
  """Builds the transition table of `stop` over a vocabulary, on the host.

  Args:
    stop: the stop strings; an empty list never stops.
    token_bytes: [V'] the bytes each id decodes to
      (`Tokenizer.token_bytes`), b"" for special tokens.
    vocab_size: V >= V', the model's vocabulary (often padded past the
      tokenizer's); ids from V' on leave the state unchanged. Default V'.

  Returns:
    The table, numpy leaves.

  Raises:
    ValueError: a bad stop list (`validate`) or `vocab_size` < V'.
  """
  patterns = [s.encode("utf-8") for s in validate(stop)]
  v_tok = len(token_bytes)
  v = v_tok if vocab_size is None else int(vocab_size)
  if v < v_tok:
    raise ValueError(f"vocab_size={v} is smaller than the tokenizer's "
                     f"{v_tok} tokens.")
  delta, n = _automaton(patterns)  # state n: a stop string completed
  q = max(8, 1 << (n - 1).bit_length())
  table = np.zeros((q, v), np.int16)  # padding states are never reached
  table[:n] = np.arange(n, dtype=np.int16)[:, None]  # b"": no move
  start, ids, ends = _run_tokens(delta, n, token_bytes)
  table[:n, :v_tok] = np.where(start == n, STOPPED, start)
  table[:n, ids] = np.where(ends == n, STOPPED, ends)
  return StopStrings(transitions=table)


def _automaton(patterns: list[bytes]) -> tuple[np.ndarray, int]:
  """The Aho–Corasick automaton of `patterns`, completed matches merged.

  Returns:
    delta: [n + 1, 256] int32, the state after one byte. States 0..n-1 are
      the trie nodes at which no pattern has completed (0 the root, still
      the start); n is the sink every completed match goes to, and stays.
    n: the number of those states.
  """
  goto = [{}]  # trie node -> {byte: child}
  ends = [False]  # a pattern ends at the node or at one of its suffixes
  for p in patterns:
    node = 0
    for byte in p:
      if byte not in goto[node]:
        goto[node][byte] = len(goto)
        goto.append({})
        ends.append(False)
      node = goto[node][byte]
    ends[node] = True
  full = np.zeros((len(goto), 256), np.int32)  # the DFA over trie nodes
  fail = [0] * len(goto)
  order = list(goto[0].values())  # breadth first: fail links come first
  full[0, list(goto[0])] = order
  for node in order:
    ends[node] = ends[node] or ends[fail[node]]
    full[node] = full[fail[node]]
    for byte, child in goto[node].items():
      fail[child] = full[fail[node], byte]
      full[node, byte] = child
      order.append(child)
  # Renumber: nodes where no match has completed first, then one sink.
  live = np.flatnonzero(~np.array(ends))
  n = len(live)
  new = np.full(len(goto), n, np.int32)
  new[live] = np.arange(n, dtype=np.int32)
  delta = np.full((n + 1, 256), n, np.int32)
  delta[:n] = new[full[live]]
  return delta, n


def _run_tokens(delta: np.ndarray, n: int, token_bytes: Sequence[bytes]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Reads every token from every state 0..n-1 of `_automaton`'s `delta`.

  One pass per byte position over all tokens at once. From any state, a
  token soon reaches the state it reaches from the start (or the sink, which
  it then keeps): its column has collapsed to the start row, which one
  cheap pass over every token's bytes gives. Until then, what a token has
  reached depends only on the prefix read so far, so rows are computed once
  per distinct prefix: [n, prefixes] per position, usually a few hundred
  columns, not n·V'·(longest token).

  Returns:
    start: [V'] int32, the end state of each token from the start.
    ids: [E] int32, the tokens whose end state differs from `start` in
      some row.
    ends: [n, E] int32, their end states from each state.
  """
  # States are kept times 256, so that state + byte indexes `flat_delta`.
  sink = n * 256
  flat_delta = (delta * 256).reshape(-1)
  v = len(token_bytes)
  lengths = np.fromiter(map(len, token_bytes), np.int64, v)
  flat = np.frombuffer(b"".join(token_bytes) + b"\0", np.uint8)
  offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  # The start row: every token from state 0, longest tokens first.
  order = np.argsort(-lengths, kind="stable")
  descending = -lengths[order]
  start = np.zeros(v, np.int64)
  for j in range(int(lengths.max(initial=0))):
    ids = order[:np.searchsorted(descending, -j, side="left")]  # len > j
    start[ids] = flat_delta[start[ids] + flat[offsets[ids] + j]]
  # Every row, for the tokens not collapsed yet: their ids and prefixes.
  tokens = np.flatnonzero(lengths > 0)
  prefix = np.zeros(len(tokens), np.int64)  # [m] column of `rows`
  rows = np.arange(n, dtype=np.int64)[:, None] * 256  # [n, prefixes]
  empty = np.flatnonzero(lengths == 0)  # b"": no move
  out_ids = [empty]
  out_ends = [np.repeat(rows, len(empty), axis=1)]
  j = 0
  while len(tokens):
    byte = flat[offsets[tokens] + j]
    keys, prefix = np.unique(prefix * 256 + byte, return_inverse=True)
    rows = flat_delta[rows[:, keys // 256] + keys % 256]  # [n, prefixes]
    # Row 0 is the start state. A column whose rows all equal it or are in
    # the sink has collapsed: from here on, its rows end where the start
    # row ends, but for those already stopped.
    stopped = rows == sink  # [n, prefixes]
    same = np.all((rows == rows[:1]) | stopped, axis=0)  # [prefixes]
    some_stopped = ~np.all(rows == rows[:1], axis=0)  # (when `same`)
    last = lengths[tokens] == j + 1  # [m] the token's last byte
    # Recorded now: tokens that end uncollapsed, and collapsed ones with
    # rows already stopped; the others are the start row's.
    record = ~same[prefix] & last | same[prefix] & some_stopped[prefix]
    if record.any():
      cols = prefix[record]
      out_ids.append(tokens[record])
      out_ends.append(np.where(same[cols] & ~stopped[:, cols],
                               start[tokens[record]], rows[:, cols]))
    keep = ~(same[prefix] | last)
    tokens, prefix = tokens[keep], prefix[keep]
    j += 1
  ids, ends = np.concatenate(out_ids), np.concatenate(out_ends, axis=1)
  return ((start // 256).astype(np.int32), ids.astype(np.int32),
          (ends // 256).astype(np.int32))


def advance(stops: StopStrings, state: jax.Array, tokens: jax.Array,
            num_new: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Reads each row's new tokens; finds the first that completes a stop.

  Pure `jnp` with static shapes: works under `jit` and `vmap`.

  Args:
    stops: the compiled stop strings.
    state: [B] int32, each row's state (`START` at its first generated
      token, `STOPPED` once a stop string completed: it stays there).
    tokens: [B, C] int32; the first `num_new[b]` of row b are read.
    num_new: [B] int32 in [0, C].

  Returns:
    state: [B] int32 after the tokens read.
    stop_at: [B] int32, the index (< num_new) of the token at which a stop
      string first completed, or C if none did (also for rows that came
      in `STOPPED`).
  """
  table = jnp.asarray(stops.transitions)
  v = table.shape[1]
  c = tokens.shape[-1]
  state = state.astype(jnp.int32)

  def step(carry, xs):
    state, stop_at = carry
    t, token = xs  # [], [B]
    # Ids outside [0, V) and tokens past num_new leave the state as is.
    read = (t < num_new) & (state >= 0) & (token >= 0) & (token < v)
    nxt = table.at[jnp.maximum(state, 0), jnp.clip(token, 0, v - 1)].get(
        mode="promise_in_bounds").astype(jnp.int32)  # [B]
    stop_at = jnp.where(read & (nxt == STOPPED), t, stop_at)
    return (jnp.where(read, nxt, state), stop_at), None

  stop_at = jnp.full(state.shape, c, jnp.int32)
  (state, stop_at), _ = jax.lax.scan(
      step, (state, stop_at),
      (jnp.arange(c, dtype=jnp.int32), jnp.moveaxis(tokens, -1, 0)),
      unroll=min(c, 16))
  return state, stop_at


def stop_index(stops: StopStrings, ids: Sequence[int]) -> int | None:
  """`advance` on the host over one row's output ids, from `START`.

  Args:
    stops: the compiled stop strings (keep the host copy: device leaves
      are copied back at each call).
    ids: [N] one row's generated ids.

  Returns:
    The index of the token at which a stop string first completed, or None.
  """
  table = np.asarray(stops.transitions)
  v = table.shape[1]
  state = START
  for i, token in enumerate(ids):
    token = int(token)
    if 0 <= token < v:
      state = int(table[state, token])
      if state == STOPPED:
        return i
  return None


def truncate_text(text: str, stop: Sequence[str]) -> str:
  """Cuts `text` where the first stop string to end in it ends.

  The stop string is kept and what follows dropped, as Hugging Face's
  `stop_strings` keep it; text holding none comes back whole.
  """
  stop = validate(stop)
  ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
  return text[:min(ends)] if ends else text
