"""Optional dependencies, imported where they are used.

`pip install specjax` installs what `import specjax.decode` and the model
loaders need. Features with heavier or rarer dependencies import them
through `require` at the point of use, so a missing package fails there
with the `pip install "specjax[EXTRA]"` line that brings it, rather than
at import time or with a bare `ModuleNotFoundError`.
"""

from __future__ import annotations

import importlib
import types


def require(module: str, extra: str) -> types.ModuleType:
  """Imports `module`, or says which specjax extra installs it.

  Args:
    module: a dotted module name, e.g. "outlines_core" or
      "matplotlib.pyplot".
    extra: the setup.cfg extra that declares the package, e.g.
      "structured".

  Returns:
    The imported module.

  Raises:
    ModuleNotFoundError: `module`'s package is not installed; the message
      names the extra to install. A package that is installed but fails to
      import (one of its own dependencies missing, say) raises its own
      error unchanged.
  """
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    top = module.partition(".")[0]
    if (e.name or "").partition(".")[0] != top:
      raise
    raise ModuleNotFoundError(
        f"{module!r} is not installed; this feature needs the specjax "
        f'extra {extra!r}: pip install "specjax[{extra}]"',
        name=e.name) from e
