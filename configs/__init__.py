"""Experiment configs (ml-collections), loaded with `--config=configs/X.py`.

Each file defines `get_config(arg=None)`; `arg` is the small string after the
file name (`configs/llama_pair.py:pair=smollm2,gamma=4`), parsed by
`parse_arg`. Field overrides go through `--config.field=value` as usual.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parse_arg", "parse_ints", "parse_optional_float",
           "parse_strings"]


def _convert(key: str, value: str, default: Any) -> Any:
  if isinstance(default, bool):
    if value.lower() in ("1", "true", "yes", ""):
      return True
    if value.lower() in ("0", "false", "no"):
      return False
    raise ValueError(f"Config argument {key}={value!r} is not a boolean.")
  if isinstance(default, int):
    return int(value)
  if isinstance(default, float):
    return float(value)
  return value


def parse_arg(arg: str | None, **defaults: Any) -> dict[str, Any]:
  """Parses `k1=v1,k2=v2` into a dict typed like `defaults`.

  Like big_vision's `parse_arg`: every key must have a default, whose type
  converts the string (a bare `key` sets a boolean to True).

  Args:
    arg: the argument string after `:` in `--config=file.py:arg`, or None.
    **defaults: every accepted key with its default value.

  Returns:
    `defaults` updated with the parsed values.

  Raises:
    ValueError: an unknown key, or a value that does not convert.
  """
  out = dict(defaults)
  if not arg:
    return out
  for item in arg.split(","):
    if not item:
      continue
    key, _, value = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"Unknown config argument {key!r}; known: "
                       f"{sorted(defaults)}.")
    try:
      out[key] = _convert(key, value.strip(), defaults[key])
    except ValueError as e:
      raise ValueError(f"Config argument {key}={value!r}: {e}") from None
  return out


def parse_ints(value: str, name: str) -> tuple[int, ...]:
  """`1/2/4/8` (`/` separates values inside config arguments) -> a tuple."""
  if not value:
    return ()
  try:
    return tuple(int(v) for v in value.split("/") if v)
  except ValueError:
    raise ValueError(f"Config argument {name}={value!r} must be integers "
                     "separated by '/', e.g. 1/2/4/8.") from None


def parse_optional_float(value: str, name: str) -> float | None:
  """`` -> None (off); `1.1` -> 1.1."""
  if value in ("", "none", "None"):
    return None
  try:
    return float(value)
  except ValueError:
    raise ValueError(f"Config argument {name}={value!r} must be a number "
                     "(or empty: off).") from None


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "/": "/"}


def parse_strings(value: str, name: str) -> tuple[str, ...]:
  r"""`a/b\/c/\n\n` -> ("a", "b/c", "\n\n"): `/` separates the strings,
  and `\n`, `\t`, `\r`, `\\` and `\/` are escapes (config arguments
  cannot hold newlines, commas or a bare `/` otherwise)."""
  out, current, i = [], [], 0
  while i < len(value):
    c = value[i]
    if c == "\\":
      if i + 1 == len(value) or value[i + 1] not in _ESCAPES:
        raise ValueError(f"Config argument {name}={value!r}: unknown escape "
                         f"at {i}; use \\n, \\t, \\r, \\\\ or \\/.")
      current.append(_ESCAPES[value[i + 1]])
      i += 2
      continue
    if c == "/":
      out.append("".join(current))
      current = []
    else:
      current.append(c)
    i += 1
  out.append("".join(current))
  return tuple(s for s in out if s)
