"""The library imports without test-only or peer-benchmark dependencies."""

import os
import subprocess
import sys

HEAVY = ("torch", "transformers", "pytest", "nbclient", "accelerate")
# Modules of setup.cfg's extras that the library imports where it uses them
# (`specjax._optional.require`), never at import time.
OPTIONAL = ("outlines_core", "jsonschema", "matplotlib", "ml_collections",
            "libtpu")


def test_decode_import_pulls_no_test_only_dependency():
  code = (
      "import sys\n"
      "import specjax.decode, specjax.checkpoints, specjax.registry\n"
      "import specjax.tokenizer, specjax.metrics\n"
      f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=300)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_library_import_pulls_no_optional_extra():
  # `pip install specjax` (no extras) is enough to import every module.
  code = (
      "import importlib, pathlib, sys\n"
      "import specjax\n"
      "root = pathlib.Path(specjax.__file__).parent\n"
      "for path in sorted(root.rglob('*.py')):\n"
      "  parts = path.relative_to(root.parent).with_suffix('').parts\n"
      "  importlib.import_module('.'.join(p for p in parts\n"
      "                                   if p != '__init__'))\n"
      f"print(sorted(m for m in {OPTIONAL + HEAVY!r} if m in sys.modules))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=300)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_module_uses_the_one_shape_glossary():
  # A module that declares shape letters cites specjax.shapes and uses only
  # letters defined there.
  import pathlib
  import re
  from specjax import shapes
  root = pathlib.Path(shapes.__file__).parent
  checked = 0
  for path in sorted(root.rglob("*.py")):
    text = path.read_text()
    match = re.search(r"Shape letters(.*?)\n\n", text, re.S)
    if match is None or path.name == "shapes.py":
      continue
    checked += 1
    assert "(`specjax.shapes`)" in match.group(1), path
    paragraph = re.sub(r"`[^`]*`", "", match.group(1))
    letters = set(re.findall(r"\b([A-Z](?:_cap)?)\b(?= |,|\)|$)",
                             paragraph))
    assert letters <= set(shapes.LETTERS), (path, letters - set(
        shapes.LETTERS))
  assert checked >= 15


def test_importing_specjax_changes_no_jax_setting():
  # Every module imported; JAX's configuration (the persistent compilation
  # cache among it) is what it was before. Decoders turn the cache on at
  # their first call instead (`specjax.compilation`).
  code = (
      "import importlib, pathlib, jax\n"
      "before = dict(jax.config.values)\n"
      "import specjax\n"
      "root = pathlib.Path(specjax.__file__).parent\n"
      "for path in sorted(root.rglob('*.py')):\n"
      "  parts = path.relative_to(root.parent).with_suffix('').parts\n"
      "  name = '.'.join(p for p in parts if p != '__init__')\n"
      "  importlib.import_module(name)\n"
      "after = dict(jax.config.values)\n"
      "print(sorted(k for k in after if after[k] != before.get(k)))\n")
  env = {k: v for k, v in os.environ.items()
         if k != "SPECJAX_NO_COMPILE_CACHE"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=300, env=env)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
