"""Loads Hugging Face safetensors checkpoints (Llama, Mistral, Qwen2, Gemma 3).

A checkpoint is a directory with `config.json` and either `model.safetensors`
or `model.safetensors.index.json` plus the shards it names, or a Hub id that
`huggingface_hub` downloads. PyTorch pickles (`*.bin`, `*.pt`) are never read.

Safetensors files are memory-mapped and parsed here rather than through
`safetensors.safe_open(framework="numpy")`, which cannot represent bfloat16:
the format is an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}`, then raw little-endian data, so each
tensor is a zero-copy `np.memmap` view (bfloat16 and float8 through
`ml_dtypes`), read only when the converter asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import json
import os
import re
import struct
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax import sharding
from specjax.checkpoints import convert
from specjax.models import Model
from specjax.models import quantized
from specjax.models import QuantSpec

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# What `load_hf` fetches for a Hub id: config, weights and tokenizer files.
HUB_PATTERNS = [
    CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, "model-*.safetensors",
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model",
]

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_HUB_ID_RE = re.compile(r"[\w.-]+(/[\w.-]+)?")


def load_hf(path: str | os.PathLike[str],
            dtype: Any = jnp.float32, *, mesh: Any = None,
            split: bool = True, quantize: str | None = None) -> Model:
  """Loads a Hugging Face Llama-family or Gemma 3 checkpoint as a `Model`.

  Args:
    path: a local checkpoint directory, or a Hugging Face Hub id such as
      `HuggingFaceTB/SmolLM2-135M` (downloaded with `huggingface_hub`).
    dtype: dtype of the returned parameters (tensors are cast).
    mesh: a `jax.sharding.Mesh` to place each tensor on as it is read
      (`specjax.sharding.placer`; `split=False` replicates), or None for
      the default device.
    split: with `mesh`, split the model (else replicate it).
    quantize: None, or "int8" / "int4" (`QuantSpec.parse`): weight-only
      quantize every matrix once loaded. ("gguf" needs a GGUF file.)

  Returns:
    The model, parameters on the default device or on `mesh`.

  Raises:
    FileNotFoundError: the directory, its config.json, or its safetensors
      files are missing.
    ConnectionError: `path` is no local directory and the Hub could not be
      reached.
    ValueError: the architecture or a config feature is unsupported, or a
      tensor is missing, unexpected or misshapen.
  """
  spec = check_quantize(quantize, str(path), mesh)
  directory = resolve(os.fspath(path))
  config_path = os.path.join(directory, CONFIG_NAME)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(
        f"{directory!r} has no {CONFIG_NAME}; expected a Hugging Face "
        "checkpoint directory.")
  with open(config_path) as f:
    try:
      hf_config = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{config_path!r} is not valid JSON: {e}") from e
  config = convert.config_from_hf(hf_config)
  tensors = SafetensorsDir(directory)
  place = None if mesh is None else sharding.placer(config, mesh,
                                                     split=split)
  params = convert.params_from_tensors(config, tensors, dtype, place)
  model = Model(config=config, params=params, mesh=mesh)
  return model if spec is None else model.quantize(spec, donate=True)


def check_quantize(quantize: str | None, source: str,
                   mesh: Any = None) -> QuantSpec | None:
  """The QuantSpec of a float checkpoint's `quantize` argument.

  Raises:
    ValueError: "gguf" (the checkpoint has no blocks to keep), an unknown
      name, or quantization with a mesh (quantized matrices are not
      sharded), naming `source`.
  """
  spec = quantized.parse(quantize)
  if spec == "gguf":
    raise ValueError(f"quantize='gguf' keeps a GGUF file's own blocks, but "
                     f"{source} is a float checkpoint; use 'int8' or 'int4'.")
  if spec is not None and mesh is not None:
    raise ValueError(f"Cannot load {source} quantized ({quantize!r}) onto a "
                     "mesh: quantized matrices are not sharded.")
  return spec


def resolve(path: str) -> str:
  """A local directory for `path`, downloading Hub ids if possible."""
  if os.path.isdir(path):
    return path
  if os.path.exists(path):
    raise NotADirectoryError(
        f"{path!r} is a file; pass the checkpoint directory holding "
        f"{CONFIG_NAME} and the safetensors weights.")
  if os.path.isabs(path) or path.startswith((".", "~")) or (
      not _HUB_ID_RE.fullmatch(path)):
    raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist.")
  try:
    # pylint: disable=g-import-not-at-top
    import huggingface_hub
    from huggingface_hub import errors as hub_errors
  except ImportError:
    raise FileNotFoundError(
        f"{path!r} is not a local directory, and huggingface_hub is not "
        "installed to download it from the Hugging Face Hub.") from None
  try:
    return huggingface_hub.snapshot_download(path,
                                             allow_patterns=HUB_PATTERNS)
  except hub_errors.RepositoryNotFoundError as e:
    raise FileNotFoundError(
        f"{path!r} is neither a local directory nor a Hugging Face Hub "
        f"repository you can access ({type(e).__name__}).") from e
  except Exception as e:  # pylint: disable=broad-except
    raise ConnectionError(
        f"{path!r} is not a local directory and the Hugging Face Hub could "
        f"not be reached to download it ({type(e).__name__}: {e}). Pass a "
        f"local directory holding {CONFIG_NAME} and the safetensors weights "
        "instead.") from e


class SafetensorsDir(Mapping[str, np.ndarray]):
  """The tensors of a checkpoint directory, by name, memory-mapped lazily.

  Attributes:
    directory: the checkpoint directory.
    files: tensor name -> path of the safetensors file holding it.
  """

  def __init__(self, directory: str):
    self.directory = directory
    self.files = _weight_files(directory)
    self._headers: dict[str, tuple[dict[str, Any], int]] = {}
    for name, file in self.files.items():
      header, _ = self._header(file)
      if name not in header:
        raise ValueError(f"{INDEX_NAME} puts {name!r} in {file!r}, which "
                         "does not contain it.")

  def _header(self, file: str) -> tuple[dict[str, Any], int]:
    """(header, data start) of one file, parsed once."""
    if file not in self._headers:
      self._headers[file] = read_header(file)[:2]
    return self._headers[file]

  def __getitem__(self, name: str) -> np.ndarray:
    file = self.files[name]
    header, start = self._header(file)
    info = header[name]
    dtype = DTYPES[info["dtype"]]
    shape = tuple(info["shape"])
    begin, _ = info["data_offsets"]
    if not shape or 0 in shape:
      return np.zeros(shape, dtype)  # np.memmap rejects empty views.
    return np.memmap(file, dtype=dtype, mode="r", offset=start + begin,
                     shape=shape)

  def __iter__(self) -> Iterator[str]:
    return iter(self.files)

  def __len__(self) -> int:
    return len(self.files)


def _weight_files(directory: str) -> dict[str, str]:
  """Tensor name -> safetensors file, from the single file or the index."""
  single = os.path.join(directory, WEIGHTS_NAME)
  if os.path.isfile(single):
    return {name: single for name in read_header(single)[0]}
  index_path = os.path.join(directory, INDEX_NAME)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index_path!r} has no weight_map.")
    files = {name: os.path.join(directory, shard)
             for name, shard in weight_map.items()}
    missing = sorted({f for f in files.values() if not os.path.isfile(f)})
    if missing:
      raise FileNotFoundError(f"{INDEX_NAME} in {directory!r} names shards "
                              f"that do not exist: {missing}")
    return files
  present = sorted(os.listdir(directory))
  pickles = [f for f in present if f.endswith((".bin", ".pt", ".pth"))]
  hint = (f" It has PyTorch pickle files {pickles}, which specjax does not "
          "load (unpickling can run arbitrary code); convert them to "
          "safetensors first." if pickles else "")
  raise FileNotFoundError(
      f"{directory!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME} (it holds "
      f"{present}).{hint}")


def read_header(file: str) -> tuple[dict[str, Any], int, dict[str, str]]:
  """Parses and checks a safetensors header.

  Args:
    file: path of a `.safetensors` file.

  Returns:
    ({tensor name: {'dtype', 'shape', 'data_offsets'}}, byte offset where
    the data section starts, the `__metadata__` strings or {}).

  Raises:
    ValueError: the file is truncated, not safetensors, or uses a dtype that
      numpy cannot hold.
  """
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise ValueError(f"{file!r} is too short to be a safetensors file.")
    (length,) = struct.unpack("<Q", prefix)
    if 8 + length > size:
      raise ValueError(f"{file!r} is not a safetensors file (header length "
                       f"{length} exceeds the file size {size}).")
    try:
      header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{file!r} has a corrupt safetensors header.") from e
  if not isinstance(header, dict):
    raise ValueError(f"{file!r} has a corrupt safetensors header.")
  metadata = header.pop("__metadata__", None) or {}
  start = 8 + length
  for name, info in header.items():
    try:
      dtype, shape, (begin, end) = (info["dtype"], info["shape"],
                                    info["data_offsets"])
      nbytes = int(np.prod(shape, dtype=np.int64))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"Tensor {name!r} in {file!r} has a corrupt header "
                       f"entry {info!r}.") from e
    if dtype not in DTYPES:
      raise ValueError(f"Tensor {name!r} in {file!r} has unsupported dtype "
                       f"{dtype}.")
    if end - begin != nbytes * DTYPES[dtype].itemsize or start + end > size:
      raise ValueError(f"Tensor {name!r} in {file!r} is truncated or its "
                       "offsets do not match its shape.")
  return header, start, metadata
