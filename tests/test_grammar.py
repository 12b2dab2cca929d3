"""Grammar tables against outlines-core's own index, the regex and the schema.

Two small real tokenizers: a byte-level BPE (`byte_level_bpe`, GPT-2's byte
alphabet, merges that split 'é' across tokens) and a Gemma-style
SentencePiece (`sentencepiece_bpe`, '▁' and `<0xNN>` byte fallback). The
compressed tables are checked state by state against outlines-core's
`Index` (allowed tokens, next states, accepting states); random walks
through `mask_logits` / `advance` must decode to text that `re.fullmatch`
accepts, or that `json.loads` parses and `jsonschema.validate` accepts;
`forced` / `forced_chain` against a brute-force count on the dense mask.
"""

import collections
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import outlines_core
import pytest

from specjax import grammar as grammar_lib
from specjax import tokenizer as tokenizer_lib

_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6

# Merged byte strings of the byte-level vocabulary, each of two earlier
# tokens (the split is the merge rule).
_MERGES = [
    (b"n", b"a"), (b"m", b"e"), (b"na", b"me"), (b'"', b"name"),
    (b'"name', b'"'), (b"{", b'"'), (b'"', b":"), (b'"', b","), (b" ", b'"'),
    (b"a", b"g"), (b"ag", b"e"), (b"1", b"2"), (b"0", b"0"), (b"a", b"b"),
    (b"ab", b"c"), (b"\xc3", b"\xa9"), (b"\xc3\xa9", b"\xc3\xa9"),
    (b"h", b"e"), (b"he", b"l"), (b"hel", b"l"), (b"hell", b"o"),
    (b"hel", b"p"), (b" ", b"w"), (b" w", b"o"), (b" wo", b"r"),
    (b"\\", b'"'), (b'"', b"}"), (b"]", b"}"), (b"[", b'"'),
]

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer"},
                         "tags": {"type": "array",
                                  "items": {"type": "string"}}},
          "required": ["name", "age"]}

REGEXES = [
    r"[a-c]{2,4}(x|yz)*",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    r"(hello|help) world!?",
    r"é+[0-9]{1,3}",
    r"x(yz|yw)q",
]


@functools.cache
def byte_level() -> tokenizer_lib.Tokenizer:
  spell = tokenizer_lib._byte_spelling()  # pylint: disable=protected-access

  def spelled(b):
    return "".join(spell[c] for c in b)

  tokens = [spell[b] for b in range(256)]
  merges = []
  for left, right in _MERGES:
    merges.append(f"{spelled(left)} {spelled(right)}")
    tokens.append(spelled(left + right))
  types = [1] * len(tokens)
  tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
  types += [_CONTROL, _CONTROL, _CONTROL, _USER_DEFINED]
  backend = tokenizer_lib.byte_level_bpe(tokens, merges, types, "qwen2")
  return tokenizer_lib.Tokenizer(
      backend, eos_ids=[tokens.index("<|im_end|>"),
                        tokens.index("<|endoftext|>")])


@functools.cache
def sentencepiece() -> tokenizer_lib.Tokenizer:
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  pieces = ["\u2581", "a", "b", "c", "ab", "abc", "0", "1", "2", "12", "9",
            "{", "}", "[", "]", '"', ":", ",", '{"', '":', "\u2581\"",
            "n", "m", "e", "g", "na", "me", "name", "age", "é", "éé", "h",
            "l", "o", "p", "he", "hel", "hello", "help", "\u2581world", "w",
            "r", "d", "!", "x", "y", "z", "q", "-", "."]
  tokens += pieces + ["<start_of_turn>", "<end_of_turn>"]
  types = [_CONTROL, _CONTROL, _CONTROL, 2] + [_BYTE] * 256
  types += [1] * len(pieces) + [_CONTROL, _CONTROL]
  backend = tokenizer_lib.sentencepiece_bpe(tokens, types, unk_id=3)
  return tokenizer_lib.Tokenizer(
      backend, bos_id=2, eos_ids=[1, tokens.index("<end_of_turn>")])


TOKENIZERS = {"byte_level": byte_level, "sentencepiece": sentencepiece}


@functools.cache
def compiled(name: str, regex: str | None = None,
             schema: str | None = None, single_eos: bool = False):
  tok = TOKENIZERS[name]()
  eos = tok.eos_ids[:1] if single_eos else tok.eos_ids
  grammar = grammar_lib.compile_grammar(tok, regex=regex, json_schema=schema,
                                        eos_ids=eos)
  return tok, grammar


def dense_allowed(grammar) -> np.ndarray:
  """[Q, V] bool: every state's mask through the device function."""
  states = jnp.arange(grammar.transitions.shape[0])
  return np.asarray(jax.jit(grammar_lib.allowed)(grammar, states))


def outlines_index(tok, regex=None, schema=None):
  if schema is not None:
    regex = outlines_core.json_schema.build_regex_from_schema(schema)
  return outlines_core.Index(regex, grammar_lib.vocabulary(tok))


# ------------------------------------------------------------ vocabulary

TEXTS = ['{"name": "héllo", "age": 12}', "hello world\n", "ééé 9!",
         "<tool> x\t\\\"", "日本語 🤖"]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_token_bytes_spell_what_the_tokenizer_encodes(name):
  tok = TOKENIZERS[name]()
  spelled = tok.token_bytes()
  assert len(spelled) == tok.vocab_size
  for text in TEXTS:
    ids = tok.encode(text, add_bos=False)
    assert b"".join(spelled[i] for i in ids) == text.encode(), text
    assert tok.decode(ids) == text


def test_vocabulary_keeps_plain_and_user_tokens_only():
  tok = byte_level()
  vocab = grammar_lib.vocabulary(tok)
  assert vocab.get_eos_token_id() == tok.eos_ids[0]
  for special in (b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>"):
    assert vocab.get(special) is None
  assert vocab.get(b"<tool>") == [tok.backend.token_to_id("<tool>")]
  assert vocab.get(b"\xc3") == [0xC3]  # byte tokens in byte order
  assert vocab.get("éé".encode()) is not None
  assert grammar_lib.vocabulary(tok) is vocab  # cached

  sp = sentencepiece()
  vocab = grammar_lib.vocabulary(sp)
  assert vocab.get(b"<unk>") is None and vocab.get(b"<pad>") is None
  assert vocab.get(b"<start_of_turn>") is None
  # The byte-fallback token and the 'a' piece both spell b"a".
  assert sorted(vocab.get(b"a")) == [4 + ord("a"), sp.backend.token_to_id(
      "a")]
  assert vocab.get(b" ") == [4 + 0x20, sp.backend.token_to_id("\u2581")]


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct-float32",
                                  "gemma-3-270m-float32"])
def test_token_bytes_of_real_tokenizers(name):
  path = pathlib.Path.home() / ".cache/specjax/converted" / name
  if not (path / "tokenizer.json").exists():
    pytest.skip(f"no converted {name}")
  tok = tokenizer_lib.Tokenizer.from_pretrained_dir(path)
  spelled = tok.token_bytes()
  for text in TEXTS + ["    def f(x):\n\treturn {'a': [1, 2]}  # ok"]:
    ids = tok.encode(text, add_bos=False)
    assert b"".join(spelled[i] for i in ids) == text.encode(), text


# ----------------------------------------------- tables vs outlines-core


def _reaches_final(index, start) -> bool:
  """Whether outlines-core's index reaches an accepting state from
  `start` (brute force)."""
  seen, stack = {start}, [start]
  while stack:
    q = stack.pop()
    if index.is_final_state(q):
      return True
    for t in index.get_allowed_tokens(q) or []:
      r = index.get_next_state(q, t)
      if r is not None and r not in seen:
        seen.add(r)
        stack.append(r)
  return False


CASES = ([(n, r, None) for n in TOKENIZERS for r in REGEXES]
         + [(n, None, json.dumps(SCHEMA)) for n in TOKENIZERS])


@pytest.mark.parametrize("name,regex,schema", CASES)
def test_tables_match_outlines_index(name, regex, schema):
  """Walks both automata together: at every pair of states the allowed
  sets agree (ours drops only transitions into states that can no longer
  finish), next states correspond one to one, and so do accepting
  states."""
  tok, grammar = compiled(name, regex, schema)
  index = outlines_index(tok, regex, schema)
  mask = dense_allowed(grammar)
  table = np.asarray(grammar.transitions)
  token_class = np.asarray(grammar.token_class)
  eos = set(tok.eos_ids)
  ours_of, theirs_of, done, stuck = {}, {}, set(), {}
  pairs = collections.deque([(index.get_initial_state(), grammar_lib.START)])
  while pairs:
    o, s = pairs.popleft()
    if ours_of.setdefault(o, s) != s or theirs_of.setdefault(s, o) != o:
      pytest.fail(f"outlines-core state {o} and state {s} pair differently")
    if o in done:
      continue
    done.add(o)
    final = index.is_final_state(o)
    assert bool(grammar.final[s]) == final
    theirs = set(index.get_allowed_tokens(o) or []) - eos
    ours = set(np.flatnonzero(mask[s]).tolist())
    assert (ours & eos) == (eos if final else set())
    assert ours - eos <= theirs
    for t in sorted(theirs):
      o2 = index.get_next_state(o, t)
      if t in ours:
        s2 = int(table[s, token_class[t]])
        assert s2 >= 0
        pairs.append((o2, s2))
      else:  # dropped: outlines-core's walk would be stuck there
        if o2 not in stuck:
          stuck[o2] = not _reaches_final(index, o2)
        assert stuck[o2], (o, t)
  assert len(done) == int(np.sum(grammar.live))
  assert not np.any(mask[~np.asarray(grammar.live)])
  # `advance` on every (state, token): the table where allowed, else dead.
  nxt = jax.jit(grammar_lib.advance)(
      grammar, np.arange(table.shape[0])[:, None],
      np.arange(grammar.vocab_size)[None])
  np.testing.assert_array_equal(nxt, np.where(mask, table[:, token_class],
                                              -1))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_classes_are_the_coarsest_partition(name):
  """No two classes behave alike in every state: the class count is the
  least possible."""
  _, grammar = compiled(name, None, json.dumps(SCHEMA))
  live = np.asarray(grammar.live)
  token_class = np.asarray(grammar.token_class)
  num_classes = token_class.max() + 1
  columns = np.asarray(grammar.transitions)[live][:, :num_classes]
  assert np.unique(columns.T, axis=0).shape[0] == num_classes
  assert np.all(np.asarray(grammar.transitions)[:, num_classes:] == -1)


def test_hash_collisions_fall_back_to_exact_refinement(monkeypatch):
  """A hash that merges every token is caught by the exact check."""
  tok = byte_level()
  expected = grammar_lib.compile_grammar(tok, json_schema=SCHEMA)
  monkeypatch.setattr(grammar_lib, "_classes_hashed",
                      lambda rows, v: np.zeros(v, np.int64))
  got = grammar_lib.compile_grammar(tok, json_schema=SCHEMA)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)


class _FakeIndex:
  """outlines-core's `Index` interface over a hand-written table."""

  def __init__(self, transitions, initial, finals):
    self.transitions, self.initial, self.finals = transitions, initial, finals

  def get_initial_state(self):
    return self.initial

  def get_allowed_tokens(self, state):
    return list(self.transitions.get(state, {})) or None

  def get_next_state(self, state, token):
    return self.transitions.get(state, {}).get(token)

  def is_final_state(self, state):
    return state in self.finals


def test_trims_dead_ends_and_unreachable_states():
  # Start 10; 13 is a dead end (not accepting, no way out), 14 is never
  # reached; token 5 is EOS.
  index = _FakeIndex({10: {0: 11, 1: 13}, 11: {2: 12, 3: 12},
                      12: {4: 12, 5: 12}, 14: {0: 12}}, 10, {12, 14})
  grammar = grammar_lib._tables(  # pylint: disable=protected-access
      index, 6, (5,), "fake", 64, 64)
  # Classes by first token: {0}, {1} (only ever into the dead end), {2, 3},
  # {4}, then EOS.
  np.testing.assert_array_equal(grammar.token_class, [0, 1, 2, 2, 3, 4])
  np.testing.assert_array_equal(grammar.transitions[:4, :6], [
      [1, -1, -1, -1, -1, -1],
      [-1, -1, 2, -1, -1, -1],
      [-1, -1, -1, 2, 2, -1],
      [-1, -1, -1, -1, -1, -1]])
  assert grammar.transitions.shape == (16, 16)
  np.testing.assert_array_equal(grammar.forced_token[:4], [0, -1, -1, -1])
  np.testing.assert_array_equal(grammar.final[:4], [False, False, True,
                                                    False])
  np.testing.assert_array_equal(grammar.live[:4], [True, True, True, False])
  with pytest.raises(ValueError, match="No string matching fake"):
    grammar_lib._tables(  # pylint: disable=protected-access
        _FakeIndex({10: {1: 13}}, 10, set()), 6, (5,), "fake", 64, 64)


# -------------------------------------------------------- random walks


@functools.partial(jax.jit, static_argnames=("batch", "steps"))
def _walk(grammar, log_weights, key, *, batch, steps):
  """`batch` walks of `steps` tokens through `mask_logits` and `advance`.

  Returns:
    tokens [B, steps] (-1 after the first EOS), states [B, steps] after
    each token.
  """

  def step(carry, key):
    state, done = carry
    logits = jnp.broadcast_to(log_weights, (batch, log_weights.size))
    logits = grammar_lib.mask_logits(grammar, state, logits)
    token = jax.random.categorical(key, logits).astype(jnp.int32)
    token = jnp.where(done, -1, token)
    new = jnp.where(done, state, grammar_lib.advance(grammar, state, token))
    is_eos = jnp.any(token[:, None] == grammar.eos_ids, axis=-1)
    return (new, done | is_eos), (token, new)

  start = jnp.full((batch,), grammar_lib.START, jnp.int32)
  _, (tokens, states) = jax.lax.scan(
      step, (start, jnp.zeros(batch, bool)), jax.random.split(key, steps))
  return tokens.T, states.T


def walks(tok, grammar, seed=0, batch=24, steps=160):
  """Finished walks as (token ids before EOS, states): every allowed class
  equally likely, then a uniform token of it (uniform over tokens would
  rarely close a string)."""
  token_class = np.asarray(grammar.token_class)
  sizes = np.bincount(token_class)
  log_weights = -np.log(sizes[token_class]).astype(np.float32)
  tokens, states = map(np.asarray, _walk(
      grammar, log_weights, jax.random.key(seed), batch=batch, steps=steps))
  out = []
  for row, row_states in zip(tokens, states):
    eos = np.flatnonzero(np.isin(row, tok.eos_ids))
    if eos.size:
      n = eos[0]
      assert np.all(row_states[:n + 1] >= 0)
      assert grammar.final[row_states[n]]
      out.append((row[:n].tolist(), row_states[:n + 1]))
  assert len(out) >= batch // 2, len(out)
  return out


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("regex", REGEXES)
def test_walks_match_the_regex(name, regex):
  tok, grammar = compiled(name, regex)
  index = outlines_index(tok, regex)
  spelled = tok.token_bytes()
  texts = set()
  for ids, _ in walks(tok, grammar):
    text = tok.decode(ids)
    assert b"".join(spelled[i] for i in ids).decode() == text
    assert re.fullmatch(regex, text), (regex, text)
    state = index.get_initial_state()  # outlines-core accepts it too
    for t in ids:
      state = index.get_next_state(state, t)
    assert index.is_final_state(state)
    texts.add(text)
  assert len(texts) > 1


@pytest.mark.parametrize("name", TOKENIZERS)
def test_walks_satisfy_the_json_schema(name):
  tok, grammar = compiled(name, None, json.dumps(SCHEMA))
  values = []
  for ids, _ in walks(tok, grammar, steps=200):
    value = json.loads(tok.decode(ids))
    jsonschema.validate(value, SCHEMA)
    values.append(value)
  assert any("tags" in v for v in values)
  assert any("tags" not in v for v in values)


def test_dead_state_and_invalid_tokens():
  tok, grammar = compiled("byte_level", "x(yz|yw)q")
  x, y, z = (tok.backend.token_to_id(c) for c in "xyz")
  s = grammar_lib.advance(grammar, grammar_lib.START, x)
  assert int(s) > 0
  assert int(grammar_lib.advance(grammar, grammar_lib.START, y)) == -1
  assert int(grammar_lib.advance(grammar, -1, x)) == -1
  assert int(grammar_lib.advance(grammar, s, -1)) == -1
  assert int(grammar_lib.advance(grammar, s, grammar.vocab_size)) == -1
  assert not np.any(grammar_lib.allowed(grammar, -1))
  assert int(grammar_lib.forced(grammar, -1)) == -1
  # Broadcasting: [2, 1] states, [3] tokens -> [2, 3].
  out = grammar_lib.advance(grammar, jnp.array([[0], [-1]]),
                            jnp.array([x, y, z]))
  np.testing.assert_array_equal(out, [[int(s), -1, -1], [-1, -1, -1]])
  logits = jnp.zeros((2, grammar.vocab_size), jnp.bfloat16)
  masked = grammar_lib.mask_logits(grammar, jnp.array([0, -1]), logits)
  assert masked.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(masked[0], np.float32)).sum() == 1
  assert not np.isfinite(np.asarray(masked[1], np.float32)).any()
  with pytest.raises(ValueError, match="entries"):
    grammar_lib.mask_logits(grammar, 0, logits[:, :-1])


# ------------------------------------------------------------- forced


def _jump(mask, grammar, spelled, state):
  """Brute force on the dense mask: the tokens a state may jump forward
  with, {-1} for none: its one allowed token, or, outside accepting
  states, the longest allowed tokens when every allowed token spells a
  prefix of them."""
  allowed = np.flatnonzero(mask[state])
  if allowed.size == 1:
    return {int(allowed[0])}
  if grammar.final[state] or not allowed.size:
    return {-1}
  longest = max((spelled[i] for i in allowed), key=len)
  if all(longest.startswith(spelled[i]) for i in allowed):
    return {int(i) for i in allowed if spelled[i] == longest}
  return {-1}


def _chain(mask, grammar, spelled, eos, state, length):
  """Brute force: the jump-forward chain from `state`."""
  tokens = []
  while state >= 0 and len(tokens) < length:
    choice = _jump(mask, grammar, spelled, state)
    if choice == {-1}:
      break
    token = min(choice)
    tokens.append(token)
    if token in eos:
      break
    state = int(grammar_lib.advance(grammar, state, token))
  return tokens


@pytest.mark.parametrize("name,regex,schema,single_eos", [
    ("byte_level", "x(yz|yw)q", None, False),
    ("byte_level", "x(yz|yw)q", None, True),
    ("sentencepiece", "x(yz|yw)q", None, True),
    ("byte_level", None, json.dumps(SCHEMA), True),
    ("sentencepiece", None, json.dumps(SCHEMA), False),
])
def test_forced_tokens_match_brute_force(name, regex, schema, single_eos):
  tok, grammar = compiled(name, regex, schema, single_eos)
  mask = dense_allowed(grammar)
  spelled = tok.token_bytes() + [b""] * (mask.shape[1] - tok.vocab_size)
  for state, token in enumerate(grammar.forced_token.tolist()):
    assert token in _jump(mask, grammar, spelled, state), state
  states = np.arange(-1, grammar.transitions.shape[0])
  np.testing.assert_array_equal(
      grammar_lib.forced(grammar, states),
      np.concatenate([[-1], grammar.forced_token]))
  length = 6
  tokens, counts = jax.jit(grammar_lib.forced_chain, static_argnums=2)(
      grammar, states.reshape(1, -1), length)
  assert tokens.shape == (1, states.size, length)
  assert counts.shape == (1, states.size)
  eos = set(grammar.eos_ids.tolist())
  for i, s in enumerate(states):
    chain = _chain(mask, grammar, spelled, eos, int(s), length)
    assert int(counts[0, i]) == len(chain)
    got = tokens[0, i].tolist()[:len(chain)]
    assert [spelled[t] for t in got] == [spelled[t] for t in chain], s
  if regex and name == "byte_level":
    # x forced, then y, then a choice (z or w); q forced, then EOS if it is
    # the only EOS id.
    x, y, q = (tok.backend.token_to_id(c) for c in "xyq")
    assert tokens[0, 1].tolist()[:3] == [x, y, -1]
    after_q = grammar_lib.advance(
        grammar, grammar_lib.advance(grammar, grammar_lib.advance(
            grammar, grammar_lib.advance(grammar, 0, x), y),
            tok.backend.token_to_id("z")), q)
    assert bool(grammar_lib.accepts(grammar, after_q))
    chain, n = grammar_lib.forced_chain(grammar, after_q, 3)
    assert chain.tolist() == ([tok.eos_ids[0], -1, -1] if single_eos
                              else [-1, -1, -1])


# ----------------------------------------------------- padding, errors


def test_similar_grammars_share_one_program():
  tok = byte_level()
  small = grammar_lib.compile_grammar(tok, regex="a{3}")
  other = grammar_lib.compile_grammar(tok, regex="[bc]{5}")
  larger = grammar_lib.compile_grammar(tok, regex="[a-z]{40}")
  assert np.sum(small.live) != np.sum(other.live)
  shapes = [jax.tree.map(np.shape, g) for g in (small, other)]
  assert shapes[0] == shapes[1]
  assert jax.tree.structure(small) == jax.tree.structure(other)
  assert small.transitions.shape == (16, 16)
  assert larger.transitions.shape[0] == 64  # 41 states
  traces = []

  @jax.jit
  def f(grammar, state):
    traces.append(1)
    return grammar_lib.allowed(grammar, state).sum()

  f(small, 0)
  f(other, 0)
  assert len(traces) == 1
  f(larger, 0)
  assert len(traces) == 2


def test_vmap_over_rows_and_positions():
  tok, grammar = compiled("byte_level", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
  states = jnp.array([[0, 1, -1], [2, 0, 1]])
  mask = jax.vmap(grammar_lib.allowed, in_axes=(None, 0))(grammar, states)
  np.testing.assert_array_equal(mask, grammar_lib.allowed(grammar, states))
  assert mask.shape == (2, 3, tok.vocab_size)
  assert int(mask[0, 0, tok.backend.token_to_id("-")]) == 1


def test_vocab_size_pads_model_logits_and_vocabulary_input():
  tok = byte_level()
  grammar = grammar_lib.compile_grammar(tok, regex="ab", vocab_size=512)
  assert grammar.vocab_size == 512
  assert not np.any(dense_allowed(grammar)[:, tok.vocab_size:])
  vocab = grammar_lib.vocabulary(tok)
  shared = grammar_lib.compile_grammar(vocab, regex="ab", eos_ids=tok.eos_ids,
                                       vocab_size=tok.vocab_size)
  direct = grammar_lib.compile_grammar(tok, regex="ab")
  # A bare Vocabulary carries no bytes per id: it jumps forward with single
  # allowed tokens only, not forced texts (`_forced`).
  for a, b in zip(jax.tree.leaves(shared.replace(forced_token=None)),
                  jax.tree.leaves(direct.replace(forced_token=None))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one"),
    ({"regex": "a", "json_schema": SCHEMA}, "exactly one"),
    ({"regex": "(a"}, "cannot build an automaton for regex '\\(a'"),
    ({"regex": "a(?=b)"}, "cannot build an automaton"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": "[1, 2]"}, "must be a JSON object"),
    ({"json_schema": {"type": "frobnicate"}}, "Unsupported type: frobnicate"),
    ({"json_schema": {"$ref": "#/nowhere"}}, "cannot turn this JSON schema"),
    ({"regex": "[a-z]{40}", "max_states": 32}, r"41 states.*max_states=32"),
    ({"json_schema": SCHEMA, "max_classes": 8},
     r"into \d+ token classes.*max_classes=8"),
    ({"regex": "a", "eos_ids": [10**6]}, "EOS ids"),
])
def test_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    grammar_lib.compile_grammar(byte_level(), **kwargs)


def test_a_vocabulary_input():
  vocab = outlines_core.Vocabulary(9, {b"a": [0], b"b": [1]})
  with pytest.raises(ValueError, match="vocab_size is required"):
    grammar_lib.compile_grammar(vocab, regex="ab")
  with pytest.raises(ValueError, match="incompatible"):
    grammar_lib.compile_grammar(vocab, regex="c", vocab_size=10)
  with pytest.raises(ValueError, match="must hold the vocabulary's EOS"):
    grammar_lib.compile_grammar(vocab, regex="a", vocab_size=10,
                                eos_ids=[3])
  grammar = grammar_lib.compile_grammar(vocab, regex="ab", vocab_size=10)
  assert grammar.summary() == ("Grammar(3 states, 4 token classes; tables "
                               "[16, 16] over V = 10)")
  # An EOS id that is also a plain token is only ever EOS.
  vocab = outlines_core.Vocabulary(9, {b"a": [0], b"b": [1], b"c": [2]})
  grammar = grammar_lib.compile_grammar(vocab, regex="a[bc]*",
                                        eos_ids=[9, 2], vocab_size=10)
  mask = dense_allowed(grammar)
  np.testing.assert_array_equal(np.flatnonzero(mask[0]), [0])
  after_a = int(grammar_lib.advance(grammar, 0, 0))
  np.testing.assert_array_equal(np.flatnonzero(mask[after_a]), [1, 2, 9])
  assert int(grammar_lib.advance(grammar, after_a, 2)) == after_a
