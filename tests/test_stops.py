"""Stop strings on token ids (`specjax.stops`) against text search.

The reference never sees the automaton: it decodes the ids read so far to
text and asks Python's `in` whether a stop string is there, for every
prefix. Cases cover every way a stop string can meet token boundaries; a
randomised test does the same over real tokenizers' tokenisations.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders
from tokenizers import models

from specjax import stops as stops_lib
from specjax import tokenizer as tokenizer_lib

CONVERTED = pathlib.Path.home() / ".cache" / "specjax" / "converted"

# ------------------------------------------------------------- tokenizers

# Words merged into single tokens of the small byte-level BPE, so that stop
# strings fall inside, across and around tokens.
_WORDS = ["\n\n", " def", "def", "```", "``", "aa", "aab", "ab", " x",
          "ing", "→", "é", "    ", "\n\n\n", "de", "ef", "return", "()"]


@pytest.fixture(scope="module")
def byte_tok():
  """A small Qwen-style byte-level BPE, with a control and an added token."""
  spell = tokenizer_lib._byte_spelling()  # pylint: disable=protected-access
  tokens = [spell[b] for b in range(256)]
  merges = []
  for word in _WORDS:
    pieces = [spell[b] for b in word.encode("utf-8")]
    for i in range(1, len(pieces)):
      left, right = "".join(pieces[:i]), pieces[i]
      if left + right not in tokens:
        merges.append(f"{left} {right}")
        tokens.append(left + right)
  tokens += ["<|endoftext|>", "<tool_call>"]
  types = [1] * (len(tokens) - 2) + [3, 4]
  backend = tokenizer_lib.byte_level_bpe(tokens, merges, types, "qwen2")
  return tokenizer_lib.Tokenizer(backend, eos_ids=[len(tokens) - 2])


@pytest.fixture(scope="module")
def sp_tok():
  """A small Gemma-style SentencePiece BPE with byte fallback."""
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  tokens += ["\u2581", "h", "e", "l", "o", "he", "ll", "hell", "hello",
             "\u2581hello", "d", "f", "de", "def", "\u2581def", "`", "``",
             "```", "\n", "\n\n", "<start_of_turn>", "x", "\u2581x"]
  types = [3, 3, 3, 2] + [6] * 256 + [1] * 18 + [4, 4, 3, 1, 1]
  backend = tokenizer_lib.sentencepiece_bpe(tokens, types, unk_id=3)
  return tokenizer_lib.Tokenizer(backend, bos_id=2, eos_ids=[1])


def _special(tok):
  return {i for i, t in tok.backend.get_added_tokens_decoder().items()
          if t.special}


def _random_text(rng, n=12):
  pieces = _WORDS + ["a", "b", "x", " ", "\n", "`", "h", "hello", " hello",
                     "日本", "€", "🤖", "<tool_call>", "<|endoftext|>",
                     "<start_of_turn>", "f", "e", "d", "\t"]
  return "".join(pieces[i] for i in rng.integers(0, len(pieces), n))


def _check_token_bytes(tok, ids_list):
  token_bytes = tok.token_bytes()
  assert len(token_bytes) == tok.vocab_size
  for ids in ids_list:
    got = b"".join(token_bytes[i] for i in ids).decode("utf-8", "replace")
    assert got == tok.decode(ids, skip_special_tokens=True), ids


def test_token_bytes_byte_level(byte_tok):
  token_bytes = byte_tok.token_bytes()
  special = _special(byte_tok)
  assert special and all(token_bytes[i] == b"" for i in special)
  assert token_bytes[byte_tok.backend.token_to_id("<tool_call>")] == (
      b"<tool_call>")
  assert token_bytes[byte_tok.encode(" def")[0]] == b" def"
  assert token_bytes[byte_tok.encode("→")[0]] == "→".encode()
  plain = [i for i in range(byte_tok.vocab_size) if i not in special]
  rng = np.random.default_rng(0)
  texts = [byte_tok.encode(_random_text(rng)) for _ in range(100)]
  randoms = [rng.integers(0, byte_tok.vocab_size, rng.integers(1, 12))
             .tolist() for _ in range(300)]  # invalid UTF-8 among them
  _check_token_bytes(byte_tok, [[i] for i in plain] + texts + randoms)


def test_token_bytes_sentencepiece(sp_tok):
  token_bytes = sp_tok.token_bytes()
  special = _special(sp_tok)
  assert special and all(token_bytes[i] == b"" for i in special)
  ids = {sp_tok.token(i): i for i in range(sp_tok.vocab_size)}
  assert token_bytes[ids["\u2581def"]] == b" def"
  assert token_bytes[ids["<0x0A>"]] == b"\n"
  assert token_bytes[ids["<0xE2>"]] == b"\xe2"
  assert token_bytes[ids["\n\n"]] == b"\n\n"
  rng = np.random.default_rng(1)
  texts = [sp_tok.encode(_random_text(rng), add_bos=False)
           for _ in range(100)]
  # `ByteFallback` turns a run of byte tokens that is not UTF-8 into one
  # U+FFFD per byte: random ids leave byte tokens out.
  words = [i for i in range(sp_tok.vocab_size)
           if i not in special and not 4 <= i < 260]
  randoms = [rng.choice(words, rng.integers(1, 12)).tolist()
             for _ in range(300)]
  singles = [[i] for i in range(sp_tok.vocab_size) if i not in special]
  _check_token_bytes(sp_tok, singles + texts + randoms)
  assert b"".join(token_bytes[i] for i in sp_tok.encode(
      "x→é", add_bos=False)) == "x→é".encode()


def test_token_bytes_unknown_decoder():
  backend = tokenizers.Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1},
                                                  unk_token="[UNK]"))
  backend.decoder = decoders.WordPiece()
  with pytest.raises(ValueError, match="WordPiece"):
    tokenizer_lib.Tokenizer(backend).token_bytes()


@pytest.mark.real_models
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct-float32",
                                  "gemma-3-270m-float32"])
def test_real_tokenizers(name):
  """The converted Qwen and Gemma tokenizers, if cached: token bytes agree
  with `decode`, and code stops found as text search finds them."""
  if not (CONVERTED / name / "tokenizer.json").exists():
    pytest.skip(f"{name} is not converted in {CONVERTED}")
  tok = tokenizer_lib.Tokenizer.from_pretrained_dir(CONVERTED / name)
  token_bytes = tok.token_bytes()
  rng = np.random.default_rng(2)
  special = _special(tok)
  plain = np.array([i for i in range(tok.vocab_size) if i not in special])
  singles = [[i] for i in rng.choice(plain, 3000, replace=False).tolist()]
  randoms = [rng.choice(plain, 8).tolist() for _ in range(300)]
  _check_token_bytes(tok, singles + randoms)
  stop = ["\n\ndef ", "```", "→"]
  stops = stops_lib.compile_stops(stop, token_bytes)
  assert stops.transitions.shape == (16, tok.vocab_size)
  code = ("x = 1\n\n\ndef f():\n    return 2  # → 3\n```py\n\n  def g "
          "\n\ndef\n\n\n\ndef  ```")
  ids = tok.encode(code, add_bos=False)
  for start in range(0, len(ids), 3):
    part = ids[start:]
    want = _reference(lambda i, part=part: tok.decode(part[:i]), len(part),
                      stop)
    assert stops_lib.stop_index(stops, part) == want, part


# -------------------------------------------------------------- helpers


def _reference(decode, n, stop):
  """First i such that the text of ids[:i+1] holds a stop string, or None."""
  for i in range(n):
    text = decode(i + 1)
    if any(s in text for s in stop):
      return i
  return None


def _bytes_reference(ids, token_bytes, stop):
  return _reference(lambda i: b"".join(token_bytes[t] for t in ids[:i])
                    .decode("utf-8", "replace"), len(ids), stop)


_advance = jax.jit(stops_lib.advance)


def _run(stops, ids, chunk=4, sizes=None):
  """`advance` over one row, `chunk` wide, reading `sizes` tokens a call
  (default `chunk`); the index of the stop token or None."""
  ids = list(ids)
  state = jnp.zeros([1], jnp.int32)
  sizes = iter(sizes or [])
  done = 0
  while done < len(ids):
    size = min(next(sizes, chunk), len(ids) - done)
    tokens = ids[done:done + size] + [0] * (chunk - size)
    state, stop_at = _advance(stops, state, jnp.array([tokens], jnp.int32),
                              jnp.array([size], jnp.int32))
    if int(stop_at[0]) < chunk:
      assert int(stop_at[0]) < size
      assert int(state[0]) == stops_lib.STOPPED
      return done + int(stop_at[0])
    assert int(state[0]) >= 0
    done += size
  return None


# A synthetic byte vocabulary: each entry one token.
VOCAB = [b"", b"a", b"b", b"aa", b"aab", b"\n", b"\n\n", b"de", b"f ",
         b"def", b" ", b"`", b"``", b"x```y", b"\xe2", b"\x86", b"\x92",
         b"\xc3", b"\xa9", "→".encode(), b"z", b"ab", b"\n\ndef x", b"c",
         b"zz\n"]
_ID = {t: i for i, t in enumerate(VOCAB)}


def _ids(*pieces):
  return [_ID[p.encode("utf-8") if isinstance(p, str) else p]
          for p in pieces]


CASES = [
    # (stop, tokens, index of the token that completes a stop or None)
    (["```"], _ids("z", "x```y", "z"), 1),  # inside a token, text around
    (["\n\ndef "], _ids("\n\ndef x"), 0),  # inside one token
    (["\n\ndef "], _ids("z", "\n", "\n", "de", "f ", "z"), 4),  # 4 tokens
    (["\n\ndef "], _ids("\n\n", "def", " ", "z"), 2),  # three tokens
    (["\n\ndef "], _ids("zz\n", "\n", "def", "z", "\n\n", "def", " "), 6),
    (["```"], _ids("`", "``"), 1),  # across two
    (["```"], _ids("`", b"", "`", "`"), 3),  # a special token between
    (["aab"], _ids("a", "a", "a", "b"), 3),  # failure links
    (["aab"], _ids("aa", "aab"), 1),
    (["aab"], _ids("aa", "ab"), 1),
    (["aab"], _ids("a", "b", "a", "ab"), 3),
    (["abab"], _ids("a", "b", "ab", "a", "b"), 2),
    (["def", "\n\n"], _ids("\n", "\n", "def"), 1),  # first to complete
    (["z", "def\n"], _ids("\n\ndef x"), None),
    (["\n\ndef x", "ef"], _ids("\n", "\n\ndef x"), 1),
    (["→"], _ids(b"\xe2", b"\x86", b"\x92"), 2),  # byte-fallback pieces
    (["→"], _ids(b"\xe2", b"\xe2", b"\x86", b"\x92"), 3),
    (["→"], _ids(b"\x86", b"\x92", "→"), 2),
    (["é", "→"], _ids("z", b"\xc3", b"\xa9"), 2),
    (["é"], _ids(b"\xc3", "z", b"\xa9"), None),
    (["b"], _ids("a", "a"), None),
]


@pytest.mark.parametrize("stop,ids,want", CASES)
def test_cases(stop, ids, want):
  assert _bytes_reference(ids, VOCAB, stop) == want  # the case is right
  stops = stops_lib.compile_stops(stop, VOCAB)
  assert stops.transitions.shape == (8, len(VOCAB))
  assert stops_lib.stop_index(stops, ids) == want
  assert _run(stops, ids, chunk=4) == want
  assert _run(stops, ids, chunk=1) == want
  assert _run(stops, ids, chunk=3, sizes=[1, 0, 2, 3, 1]) == want


def test_match_carried_across_calls():
  stops = stops_lib.compile_stops(["\n\ndef "], VOCAB)
  state = jnp.zeros([2], jnp.int32)
  first = jnp.array([_ids("z", "\n", "\n", "z"), _ids("z", "z", "z", "z")])
  state, stop_at = _advance(stops, state, first, jnp.array([3, 4]))
  assert stop_at.tolist() == [4, 4] and int(state[0]) > 0
  second = jnp.array([_ids("de", "f ", "z", "z"), _ids("de", "f ", "z", "z")])
  state, stop_at = _advance(stops, state, second, jnp.array([4, 4]))
  assert stop_at.tolist() == [1, 4]
  assert state.tolist()[0] == stops_lib.STOPPED
  # A stopped row stays stopped and reports nothing new.
  state, stop_at = _advance(stops, state, second, jnp.array([4, 4]))
  assert stop_at.tolist() == [4, 4]
  assert state.tolist()[0] == stops_lib.STOPPED


def test_num_new_masks_later_tokens():
  stops = stops_lib.compile_stops(["```", "aab"], VOCAB)
  tokens = jnp.array([_ids("`", "``", "z"), _ids("x```y", "z", "z"),
                      _ids("aa", "b", "z"), _ids("a", "a", "b")])
  state, stop_at = _advance(stops, jnp.zeros([4], jnp.int32), tokens,
                            jnp.array([1, 0, 2, 3]))
  assert stop_at.tolist() == [3, 3, 1, 2]
  assert state.tolist()[1] == stops_lib.START  # read nothing
  assert state.tolist()[0] > 0  # '`' read, '``' not


def test_vmap_and_out_of_range_ids():
  stops = stops_lib.compile_stops(["```"], VOCAB, vocab_size=40)
  assert stops.vocab_size == 40
  tokens = jnp.array([[_ids("`", "`") + [39, 99], _ids("`") + [-1] + _ids(
      "`", "`")], [_ids("``", "`", "z", "z"), _ids("z", "z", "z", "z")]])
  fn = jax.vmap(stops_lib.advance, in_axes=(None, 0, 0, 0))
  state, stop_at = jax.jit(fn)(stops, jnp.zeros([2, 2], jnp.int32), tokens,
                               jnp.full([2, 2], 4))
  # Ids past the tokenizer's vocabulary, or outside [0, V), are skipped.
  assert stop_at.tolist() == [[4, 3], [1, 4]]
  assert stops_lib.stop_index(stops, _ids("`", "`") + [39, 99, -1] + _ids(
      "`")) == 5


def test_size_class_shares_the_program():
  small = stops_lib.compile_stops(["\n\ndef ", "```"], VOCAB)
  other = stops_lib.compile_stops(["</code>"], VOCAB)
  assert small.transitions.shape == other.transitions.shape == (8, 25)
  assert small.transitions.dtype == np.int16
  larger = stops_lib.compile_stops(["0123456789"], VOCAB)
  assert larger.num_states == 16
  empty = stops_lib.compile_stops([], VOCAB)
  assert empty.num_states == 8 and not empty.transitions.any()
  fn = jax.jit(lambda *a: stops_lib.advance(*a))  # a cache of its own
  args = (jnp.zeros([2], jnp.int32), jnp.zeros([2, 3], jnp.int32),
          jnp.ones([2], jnp.int32))
  fn(small, *args)
  fn(other, *args)
  fn(empty, *args)
  assert fn._cache_size() == 1  # pylint: disable=protected-access


def _random_stops(rng, texts):
  """1-3 stop strings: slices of texts (so they occur) and fixed ones."""
  out = []
  for _ in range(rng.integers(1, 4)):
    text = texts[rng.integers(len(texts))]
    if rng.random() < 0.3 or len(text) < 2:
      out.append(["\n\ndef ", "```", "aab", "→", "é", "ing\n", " x"][
          rng.integers(7)])
      continue
    i = rng.integers(len(text) - 1)
    out.append(text[i:i + rng.integers(1, 8)])
  return [s for s in out if "\ufffd" not in s and s] or ["```"]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_random_tokenisations(kind, byte_tok, sp_tok):
  """Random ids of a real tokenizer, random stops, random step sizes:
  `advance` finds the first prefix whose text holds a stop string."""
  tok = byte_tok if kind == "byte_level" else sp_tok
  token_bytes = tok.token_bytes()
  rng = np.random.default_rng(3)

  def ids_pool():
    ids = tok.encode(_random_text(rng, 10), add_bos=False)
    if kind == "byte_level":  # any id, bytes that are no UTF-8 among them
      for _ in range(4):
        ids.insert(rng.integers(len(ids) + 1), rng.integers(tok.vocab_size))
    # (SentencePiece: byte tokens only as `encode` makes them, whole
    # characters; see `test_token_bytes_sentencepiece`.)
    return [int(i) for i in ids]

  found = []
  for _ in range(60):
    seqs = [ids_pool() for _ in range(4)]
    texts = [tok.decode(s, skip_special_tokens=True) for s in seqs]
    stop = _random_stops(rng, texts)
    stops = stops_lib.compile_stops(stop, token_bytes)
    for ids in seqs:
      want = _reference(
          lambda i, ids=ids: tok.decode(ids[:i], skip_special_tokens=True),
          len(ids), stop)
      found.append(want is not None)
      assert stops_lib.stop_index(stops, ids) == want, (stop, ids)
      sizes = rng.integers(0, 5, 40).tolist()
      assert _run(stops, ids, chunk=4, sizes=sizes) == want, (stop, ids)
  assert 60 < sum(found) < 180  # both outcomes, often


def test_truncate_text():
  assert stops_lib.truncate_text("abc```def\n\nx", ["\n\n", "```"]) == (
      "abc```")
  # The stop string that ends first wins, not the one that starts first.
  assert stops_lib.truncate_text("xabcd", ["abcd", "bc"]) == "xabc"
  assert stops_lib.truncate_text("abab", ["ab"]) == "ab"
  assert stops_lib.truncate_text("no stop here", ["```"]) == "no stop here"
  assert stops_lib.truncate_text("", ["x"]) == ""


def test_truncate_text_cuts_inside_the_stop_token():
  stop = ["```"]
  ids = _ids("z", "x```y", "z")
  at = stops_lib.stop_index(stops_lib.compile_stops(stop, VOCAB), ids)
  kept = b"".join(VOCAB[i] for i in ids[:at + 1]).decode()
  assert kept == "zx```y"
  assert stops_lib.truncate_text(kept, stop) == "zx```"


def test_errors():
  with pytest.raises(ValueError, match=r"got str; write stop=\['```'\]"):
    stops_lib.compile_stops("```", VOCAB)
  with pytest.raises(ValueError, match="list of strings, got set"):
    stops_lib.compile_stops({"a"}, VOCAB)
  with pytest.raises(ValueError, match="list of strings, got NoneType"):
    stops_lib.validate(None)
  with pytest.raises(ValueError, match="non-empty strings, got ''"):
    stops_lib.compile_stops(["a", ""], VOCAB)
  with pytest.raises(ValueError, match="non-empty strings, got 3"):
    stops_lib.compile_stops(["a", 3], VOCAB)
  with pytest.raises(ValueError, match="not valid text"):
    stops_lib.compile_stops(["\ud800"], VOCAB)
  with pytest.raises(ValueError, match="257 UTF-8 bytes in all; at most 256"):
    stops_lib.compile_stops(["x" * 200, "y" * 57], VOCAB)
  with pytest.raises(ValueError, match="at most 256"):
    stops_lib.truncate_text("text", ["é" * 129])
  with pytest.raises(ValueError, match="vocab_size=3 is smaller"):
    stops_lib.compile_stops(["a"], VOCAB, vocab_size=3)
  stops_lib.compile_stops(["x" * 256], VOCAB)  # the cap itself is fine
