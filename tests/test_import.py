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
