"""What `pip install specjax` installs: the library only, and its extras.

configs/ and experiments/ are run from the checkout, never installed as
top-level packages (a site-packages `configs` would shadow a user's own).
The cheap checks read setup.cfg; the slow one builds the wheel and lists
what it holds.
"""

from __future__ import annotations

import configparser
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import specjax
from specjax import _optional
from specjax import grammar

setuptools = pytest.importorskip("setuptools")

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What the wheel is built from; configs/ and experiments/ are copied too, so
# that a `find` that picked them up would put them in the wheel.
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "specjax",
           "configs", "experiments")


def _setup_cfg() -> configparser.ConfigParser:
  parser = configparser.ConfigParser()
  parser.read(ROOT / "setup.cfg")
  return parser


def _lines(value: str) -> list[str]:
  """The non-comment lines of a multi-line setup.cfg value."""
  return [line.strip() for line in value.splitlines()
          if line.strip() and not line.strip().startswith("#")]


def test_find_includes_only_the_library():
  include = _lines(_setup_cfg()["options.packages.find"]["include"])
  packages = setuptools.find_packages(where=ROOT, include=include)
  assert "specjax" in packages and "specjax.models" in packages
  assert {p.split(".")[0] for p in packages} == {"specjax"}, packages
  # The folders are there to be found: the include is what leaves them out.
  assert {"configs", "experiments"} <= set(
      setuptools.find_packages(where=ROOT))


def test_dev_extra_pulls_in_every_extra_the_tests_need():
  extras = _setup_cfg()["options.extras_require"]
  dev = _lines(extras["dev"])
  self_refs = [r for r in dev if r.startswith("specjax[")]
  assert len(self_refs) == 1, dev
  named = set(re.fullmatch(r"specjax\[(.*)\]", self_refs[0]).group(1)
              .split(","))
  # Not [tpu]: with libtpu installed every JAX process first tries a TPU;
  # CI installs it for its tpu_aot step alone.
  assert named == {"experiments", "structured", "reference"}
  assert named <= set(extras)


def test_version_is_read_from_the_package_and_named_in_the_changelog():
  assert _setup_cfg()["metadata"]["version"] == "attr: specjax.__version__"
  changelog = (ROOT / "CHANGELOG.md").read_text()
  latest = re.search(r"^## (\S+)", changelog, re.M).group(1)
  assert latest == specjax.__version__


def test_require_names_the_extra():
  assert _optional.require("json", "experiments").dumps([]) == "[]"
  with pytest.raises(ModuleNotFoundError,
                     match=re.escape('pip install "specjax[structured]"')):
    _optional.require("specjax_no_such_module", "structured")


def test_require_reraises_a_broken_install_unchanged(tmp_path, monkeypatch):
  # The package is there but one of its own imports is not: the error is
  # about that import, not advice to install the package again.
  (tmp_path / "specjax_broken_pkg.py").write_text(
      "import specjax_no_such_dependency\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ModuleNotFoundError) as info:
    _optional.require("specjax_broken_pkg", "structured")
  assert info.value.name == "specjax_no_such_dependency"
  assert "specjax[" not in str(info.value)


def test_grammar_without_outlines_core_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "outlines_core", None)  # not installed
  with pytest.raises(ModuleNotFoundError, match=r"specjax\[structured\]"):
    grammar.compile_grammar(None, regex="a+")


@pytest.mark.slow  # builds a wheel: a few seconds, a minute on a cold cache
def test_wheel_holds_only_the_library(tmp_path):
  source = tmp_path / "source"
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, source / name,
                      ignore=shutil.ignore_patterns("__pycache__"))
    else:
      source.mkdir(exist_ok=True)
      shutil.copy(ROOT / name, source / name)
  out = tmp_path / "wheel"
  build = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
       "--wheel-dir", str(out), str(source)],
      capture_output=True, text=True, timeout=300, check=False)
  assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
  (wheel,) = out.glob("specjax-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  top = {n.split("/")[0] for n in names}
  assert top == {"specjax", f"specjax-{specjax.__version__}.dist-info"}, top
  assert "specjax/cpu/kernels/smallm.cc" in names  # package data
  assert f"specjax-{specjax.__version__}.dist-info/licenses/LICENSE" in names
