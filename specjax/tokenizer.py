"""Text <-> token ids through Hugging Face `tokenizers`.

`Tokenizer` wraps a `tokenizers.Tokenizer` with what decoding needs: the BOS
id, every end-of-generation id, and the model's jinja chat template. It is
built from a GGUF file's metadata (`from_gguf`), a `tokenizer.json`
(`from_file`) or a Hugging Face model directory (`from_pretrained_dir`), and
saved with `save` next to a converted checkpoint.

GGUF files carry a byte-level BPE as `tokenizer.ggml.tokens`, `.merges` and
`.token_type`, plus the name of llama.cpp's pre-tokenizer (`.pre`), or (Gemma,
`tokenizer.ggml.model` 'llama') a SentencePiece BPE with byte fallback and no
merges, which `sentencepiece_bpe` rebuilds. The pre-tokenizer splits
follow llama.cpp (`llama-vocab.cpp`), as the model's own tokenizer does:
for `smollm` (SmolLM, StarCoder) every digit is split on its own, where
transformers' GGUF converter falls back to the GPT-2 split and so differs
on multi-digit numbers.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import re
from typing import Any, Sequence
import warnings

import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import normalizers
from tokenizers import pre_tokenizers
from tokenizers import Regex

# llama.cpp token types (`tokenizer.ggml.token_type`).
_CONTROL = 3
_USER_DEFINED = 4

# Names of end-of-turn / end-of-text tokens that llama.cpp also treats as
# end of generation (`llama_vocab::impl::load`, "auto-detect EOG").
_EOG_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>",
              "<|end_of_text|>", "<|end|>", "<end_of_turn>", "</s>",
              "<|return|>", "<|call|>", "<EOT>")

_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+"
               r"| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split on each digit first, regex or None for GPT-2's).
_PRE_TOKENIZERS = {
    "default": (False, None),
    "gpt2": (False, None),
    "gpt-2": (False, None),
    "mpt": (False, None),
    "olmo": (False, None),
    "qwen2": (False, _QWEN2_SPLIT),
    "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-v3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "smollm": (True, None),
    "starcoder": (True, None),
    "refact": (True, None),
    "codeshell": (True, None),
}

# SentencePiece byte-fallback token: one byte, `<0x0A>`.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# Small json written next to tokenizer.json by `save`.
METADATA_FILE = "specjax_tokenizer.json"


class Tokenizer:
  """A Hugging Face `tokenizers.Tokenizer` plus special ids and chat template.

  Attributes:
    backend: the wrapped `tokenizers.Tokenizer`.
    bos_id: beginning-of-sequence id, or None.
    eos_ids: every id that ends generation (e.g. Qwen's `<|im_end|>` and
      `<|endoftext|>`), first the model's declared EOS.
    pad_id: padding id, or None.
    add_bos: whether `encode` prepends `bos_id` by default.
    chat_template: jinja source of the chat template, or None.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *,
               bos_id: int | None = None, eos_ids: Sequence[int] = (),
               pad_id: int | None = None, add_bos: bool = False,
               chat_template: str | None = None):
    self.backend = backend
    self.bos_id = bos_id
    self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
    self.pad_id = pad_id
    self.add_bos = add_bos
    self.chat_template = chat_template
    self._token_bytes = None  # built by `token_bytes`

  # ------------------------------------------------------------ constructors

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
    """Builds the byte-level BPE a GGUF file describes.

    Args:
      path: a `.gguf` file whose `tokenizer.ggml.model` is `gpt2`, or
        `llama` (SentencePiece) in a Gemma file.

    Raises:
      ValueError: the file has no tokenizer or one specjax cannot build.
    """
    # Imported here: `specjax.checkpoints` pulls in jax and orbax.
    # pylint: disable-next=g-import-not-at-top
    from specjax.checkpoints import gguf_reader

    reader = gguf_reader.GGUFFile(path)

    def get(key, default=None):
      return reader.get(f"tokenizer.{key}", default)

    kind = get("ggml.model")
    arch = str(reader.get("general.architecture", ""))
    sentencepiece = kind == "llama" and arch.startswith("gemma")
    if kind != "gpt2" and not sentencepiece:
      raise ValueError(f"Unsupported GGUF tokenizer model {kind!r} in {path} "
                       f"(architecture {arch!r}); specjax builds byte-level "
                       "BPE ('gpt2') tokenizers, and Gemma's SentencePiece "
                       "('llama').")
    tokens = get("ggml.tokens")
    types = get("ggml.token_type") or [1] * len(tokens)
    if sentencepiece:
      backend = sentencepiece_bpe(tokens, types,
                                  get("ggml.unknown_token_id"))
    else:
      merges = get("ggml.merges") or []
      pre = get("ggml.pre", "default")
      backend = byte_level_bpe(tokens, merges, types, pre)
    bos_id = get("ggml.bos_token_id")
    eos_id = get("ggml.eos_token_id")
    eos_ids = [eos_id] if eos_id is not None else []
    for key in ("ggml.eot_token_id", "ggml.eom_token_id"):
      if get(key) is not None:
        eos_ids.append(get(key))
    eos_ids += [i for i, (t, k) in enumerate(zip(tokens, types))
                if k == _CONTROL and t in _EOG_NAMES]
    return cls(backend, bos_id=bos_id, eos_ids=eos_ids,
               pad_id=get("ggml.padding_token_id"),
               add_bos=bool(get("ggml.add_bos_token", False)),
               chat_template=get("chat_template"))

  @classmethod
  def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> "Tokenizer":
    """Loads a `tokenizer.json`; special ids and template from `kwargs`.

    Args:
      path: a `tokenizers` serialization (`tokenizer.json`).
      **kwargs: `bos_id`, `eos_ids`, `pad_id`, `add_bos`, `chat_template`.
    """
    return cls(tokenizers.Tokenizer.from_file(os.fspath(path)), **kwargs)

  @classmethod
  def from_pretrained_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
    """Loads the tokenizer of a saved specjax or Hugging Face model directory.

    Reads `tokenizer.json`, then the special ids and chat template from
    `specjax_tokenizer.json` (written by `save`), else from Hugging Face's
    `tokenizer_config.json`, `generation_config.json`, `config.json` and
    `chat_template.jinja`.

    Raises:
      FileNotFoundError: no `tokenizer.json` in `directory`.
    """
    directory = pathlib.Path(directory)
    path = directory / "tokenizer.json"
    if not path.exists():
      raise FileNotFoundError(f"No tokenizer.json in {directory}.")
    backend = tokenizers.Tokenizer.from_file(str(path))
    meta = directory / METADATA_FILE
    if meta.exists():
      return cls(backend, **json.loads(meta.read_text()))
    return cls(backend, **_hf_metadata(directory, backend))

  def save(self, directory: str | os.PathLike) -> None:
    """Writes `tokenizer.json` and `specjax_tokenizer.json` to `directory`."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    self.backend.save(str(directory / "tokenizer.json"))
    (directory / METADATA_FILE).write_text(json.dumps({
        "bos_id": self.bos_id, "eos_ids": list(self.eos_ids),
        "pad_id": self.pad_id, "add_bos": self.add_bos,
        "chat_template": self.chat_template}, indent=1))

  # --------------------------------------------------------------- encoding

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  @property
  def special_ids(self) -> tuple[int, ...]:
    """The control tokens' ids (added tokens marked special: a chat
    template's `<|im_start|>`, `<|im_end|>`, ...), ascending."""
    return tuple(sorted(
        i for i, t in self.backend.get_added_tokens_decoder().items()
        if t.special))

  @property
  def eos_id(self) -> int | None:
    """The model's declared end-of-sequence id."""
    return self.eos_ids[0] if self.eos_ids else None

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Text -> ids. Special tokens written in `text` map to their ids.

    Args:
      text: the string.
      add_bos: prepend `bos_id`; default `self.add_bos` (the model's own
        setting, False for Qwen2 and SmolLM2).
    """
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos):
      if self.bos_id is None:
        raise ValueError("add_bos=True but the tokenizer has no BOS token.")
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int],
             skip_special_tokens: bool = False) -> str:
    """Ids -> text; optionally drops special (control) tokens."""
    return self.backend.decode([int(i) for i in ids],
                               skip_special_tokens=skip_special_tokens)

  def token(self, token_id: int) -> str | None:
    """The vocabulary string of one id."""
    return self.backend.id_to_token(int(token_id))

  def token_bytes(self) -> list[bytes]:
    """The bytes each id decodes to inside text, for every id.

    Byte-level BPE (Qwen, SmolLM) spells bytes in GPT-2's alphabet, read
    back through `_byte_spelling`; a token with a character outside it (an
    added token) is its own UTF-8, as the `ByteLevel` decoder does.
    SentencePiece (Gemma) spells spaces '▁' and byte-fallback tokens
    `<0xNN>` (one byte each). Special (control) tokens and ids without a
    token are b"", so joining the bytes of ids and decoding them as UTF-8
    (errors replaced) gives `decode(ids, skip_special_tokens=True)`. One
    known difference: `tokenizers`' `ByteFallback` decoder turns a run of
    byte tokens that is not valid UTF-8 into one U+FFFD per byte, where
    UTF-8 decoding replaces only the invalid bytes.

    Returns:
      [V] bytes, indexed by id (built once and kept; each call returns a
      copy).

    Raises:
      ValueError: the decoder is neither byte-level nor SentencePiece-style
        (`Replace('▁', ' ')` with `ByteFallback`).
    """
    if self._token_bytes is None or len(
        self._token_bytes) != self.vocab_size:
      self._token_bytes = self._read_token_bytes()
    return list(self._token_bytes)

  def _read_token_bytes(self) -> list[bytes]:
    if _decoder_kind(self.backend) == "byte_level":
      inverse = {c: b for b, c in _byte_spelling().items()}

      def spell(piece):
        if set(piece) <= _byte_alphabet():
          return bytes(inverse[c] for c in piece)
        return piece.encode("utf-8")
    else:

      def spell(piece):
        if _BYTE_PIECE.fullmatch(piece):
          return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    special = set(self.special_ids)
    out = []
    for i in range(self.vocab_size):
      piece = None if i in special else self.backend.id_to_token(i)
      out.append(spell(piece) if piece else b"")
    return out

  def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                          add_generation_prompt: bool = True,
                          **kwargs: Any) -> str:
    """Renders a conversation with the model's jinja chat template.

    Rendered like transformers' `apply_chat_template(..., tokenize=False)`:
    a sandboxed jinja environment with `trim_blocks` and `lstrip_blocks`,
    the special tokens (`bos_token`, `eos_token`, ...) as variables.

    Args:
      messages: `[{'role': 'user', 'content': '...'}, ...]`.
      add_generation_prompt: end with the header of an assistant turn.
      **kwargs: extra template variables (e.g. `tools`).

    Returns:
      The prompt string (encode it with `encode`; it already holds any BOS
      text the template writes).
    """
    if self.chat_template is None:
      raise ValueError("This tokenizer has no chat template.")
    variables = {"tools": None, "documents": None}
    variables.update(self._special_tokens())
    variables.update(kwargs)
    return _compile(self.chat_template).render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt, **variables)

  def _special_tokens(self) -> dict[str, str]:
    names = {"bos_token": self.bos_id, "eos_token": self.eos_id,
             "pad_token": self.pad_id}
    return {k: self.token(i) for k, i in names.items() if i is not None}

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids})")


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str],
                   token_types: Sequence[int],
                   pre: str = "default") -> tokenizers.Tokenizer:
  """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp metadata.

  Args:
    tokens: the vocabulary, id order, spelled in GPT-2's byte alphabet.
    merges: `"a b"` merge rules, best first.
    token_types: llama.cpp token type per id; CONTROL tokens become special
      added tokens and USER_DEFINED ones plain added tokens, so either
      encodes as one id.
    pre: llama.cpp pre-tokenizer name (`tokenizer.ggml.pre`).
  """
  alphabet = _byte_alphabet()
  spell = _byte_spelling()
  # Tokens outside the byte alphabet are respelled byte by byte, as
  # transformers does, so the vocabulary stays a byte-level one.
  vocab = {}
  for i, t in enumerate(tokens):
    if not set(t) <= alphabet:
      t = "".join(spell[b] for b in t.encode("utf-8"))
    vocab.setdefault(t, i)
  pairs = [tuple(m.split(" ", 1)) for m in merges]
  backend = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=pairs, dropout=None, unk_token=None,
      fuse_unk=False, byte_fallback=False))
  if pre not in _PRE_TOKENIZERS:
    warnings.warn(f"Unknown GGUF pre-tokenizer {pre!r}; using GPT-2's split "
                  "(as transformers does).", stacklevel=2)
  digits, split = _PRE_TOKENIZERS.get(pre, (False, None))
  steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
  if split is None:
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=True))
  else:
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False,
                                       use_regex=False)]
  backend.pre_tokenizer = (steps[0] if len(steps) == 1
                           else pre_tokenizers.Sequence(steps))
  backend.decoder = decoders.ByteLevel()
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, k in zip(tokens, token_types)
             if k == _CONTROL and set(t) <= alphabet]
  user = [tokenizers.AddedToken(t, special=False, normalized=False)
          for t, k in zip(tokens, token_types)
          if k == _USER_DEFINED and t in vocab]
  backend.add_special_tokens(special)
  backend.add_tokens(user)
  return backend


def sentencepiece_bpe(tokens: Sequence[str], token_types: Sequence[int],
                      unk_id: int | None = None) -> tokenizers.Tokenizer:
  """Gemma's SentencePiece BPE as a `tokenizers.Tokenizer`, from llama.cpp
  metadata.

  Spaces are spelled '▁' (a normalizer, no prefix space), unknown bytes
  fall back to `<0xNN>` tokens. The file lists no merges; SentencePiece
  merges the adjacent pair whose union is the earliest vocabulary entry
  (Gemma's scores do not follow that order, its file order does), so each
  token's splits into two vocabulary entries become merges ranked by the
  token's id, as transformers' GGUF loader rebuilds them.

  Args:
    tokens: the vocabulary, id order; runs of spaces are stored as real
      spaces and respelled '▁'.
    token_types: llama.cpp token type per id; CONTROL tokens become special
      added tokens, USER_DEFINED ones plain added tokens.
  """
  tokens = ["\u2581" * len(t) if len(t) > 1 and not t.strip(" ") else t
            for t in tokens]
  vocab = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t, i)
  merges = []  # (rank, -len(left), -len(right), left, right)
  for rank, piece in enumerate(tokens):
    if vocab[piece] != rank:
      continue
    local = [(piece[:i], piece[i:]) for i in range(1, len(piece))
             if piece[:i] in vocab and piece[i:] in vocab]
    local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    merges += [(rank, -len(l), -len(r), l, r) for l, r in local]
  # Stable: within one rank, longer left then longer right pieces first.
  merges.sort(key=lambda m: m[:3])
  backend = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=[(l, r) for *_, l, r in merges], dropout=None,
      unk_token=None if unk_id is None else tokens[unk_id],
      fuse_unk=True, byte_fallback=True))
  backend.normalizer = normalizers.Replace(" ", "\u2581")
  backend.decoder = decoders.Sequence([
      decoders.Replace("\u2581", " "), decoders.ByteFallback(),
      decoders.Fuse()])
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, k in zip(tokens, token_types) if k == _CONTROL]
  user = [tokenizers.AddedToken(t, special=False, normalized=False)
          for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
  backend.add_special_tokens(special)
  backend.add_tokens(user)
  return backend


def _decoder_kind(backend: tokenizers.Tokenizer) -> str:
  """'byte_level' or 'sentencepiece', from the backend's decoder."""
  decoder = backend.decoder
  spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
  steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [
      spec]
  types = [step.get("type") for step in steps]
  if "ByteLevel" in types:
    return "byte_level"
  spaces = any(step.get("type") == "Replace"
               and step.get("pattern") == {"String": "\u2581"}
               and step.get("content") == " " for step in steps)
  if spaces and "ByteFallback" in types and set(types) <= {
      "Replace", "ByteFallback", "Fuse"}:
    return "sentencepiece"
  raise ValueError(
      "token_bytes knows byte-level BPE (a ByteLevel decoder) and "
      "SentencePiece BPE (Replace('\u2581', ' '), ByteFallback, Fuse) "
      f"tokenizers; this one's decoder is {spec or None}.")


@functools.cache
def _byte_spelling() -> dict[int, str]:
  """GPT-2's byte -> printable character map (`bytes_to_unicode`)."""
  keep = (list(range(ord("!"), ord("~") + 1))
          + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  out, n = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + n)
      n += 1
  return out


@functools.cache
def _byte_alphabet() -> frozenset[str]:
  return frozenset(_byte_spelling().values())


@functools.cache
def _compile(template: str):
  """A jinja template compiled the way transformers compiles chat templates."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
  import jinja2.ext  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None,
             sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = (
      lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(template)


def _hf_metadata(directory: pathlib.Path,
                 backend: tokenizers.Tokenizer) -> dict[str, Any]:
  """Special ids and chat template from a Hugging Face model directory."""

  def read(name):
    path = directory / name
    return json.loads(path.read_text()) if path.exists() else {}

  tok_config, gen_config = read("tokenizer_config.json"), read(
      "generation_config.json")
  model_config = read("config.json")

  def token_id(value):
    if isinstance(value, dict):  # serialized AddedToken
      value = value.get("content")
    return None if value is None else backend.token_to_id(value)

  def ids(value):
    if value is None:
      return []
    return list(value) if isinstance(value, (list, tuple)) else [value]

  bos_id = token_id(tok_config.get("bos_token"))
  if bos_id is None:
    bos_id = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
  eos = token_id(tok_config.get("eos_token"))
  eos_ids = ([eos] if eos is not None else []) + ids(
      gen_config.get("eos_token_id", model_config.get("eos_token_id")))
  template = tok_config.get("chat_template")
  if isinstance(template, list):  # named templates: take the default one
    template = {t["name"]: t["template"] for t in template}.get("default")
  jinja = directory / "chat_template.jinja"
  if template is None and jinja.exists():
    template = jinja.read_text()
  return {"bos_id": bos_id, "eos_ids": eos_ids,
          "pad_id": token_id(tok_config.get("pad_token")),
          "add_bos": bool(tok_config.get("add_bos_token", False)),
          "chat_template": template}
