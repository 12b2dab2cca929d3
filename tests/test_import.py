"""The library imports without test-only or peer-benchmark dependencies."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "pytest", "nbclient", "accelerate")


def test_decode_import_pulls_no_test_only_dependency():
  code = (
      "import sys\n"
      "import specjax.decode, specjax.checkpoints, specjax.registry\n"
      "import specjax.tokenizer, specjax.metrics\n"
      f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
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
