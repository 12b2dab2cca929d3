"""A JSON file of measurements keyed by machine and shapes.

Each tuner keeps one file under `$SPECJAX_CACHE/tuning/`. Reading never
fails: a file that does not parse, or whose entries do not validate, is
ignored with a `RuntimeWarning` (the caller re-measures and the file is
rewritten). Writes go to a temporary file renamed into place, so readers
never see half a file.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import warnings
from typing import Any, Callable

from specjax import paths

__all__ = ["path_for", "read", "write"]


def path_for(name: str,
             cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """`<cache>/tuning/<name>.json`."""
  return paths.cache_root(cache_dir) / "tuning" / f"{name}.json"


def read(path: pathlib.Path,
         check: Callable[[Any], None]) -> dict[str, Any]:
  """The entries of `path`, or {} when it is missing or corrupt.

  Args:
    path: the JSON file.
    check: raises ValueError, KeyError or TypeError on an invalid entry.
  """
  if not path.exists():
    return {}
  try:
    entries = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(entries, dict):
      raise ValueError("not a JSON object")
    for entry in entries.values():
      check(entry)
    return entries
  except (ValueError, KeyError, TypeError) as e:
    warnings.warn(f"Ignoring the corrupt tuning cache {path} ({e}); "
                  "re-measuring.", RuntimeWarning, stacklevel=3)
    return {}


def write(path: pathlib.Path, entries: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    json.dump(entries, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
