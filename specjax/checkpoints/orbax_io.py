"""Saves and restores a `Model` with orbax, config alongside as JSON.

A converted checkpoint reloads without re-reading or re-transposing the
original weights. Layout of a checkpoint directory:

  specjax_checkpoint.json   format tag, the `ModelConfig`, each param's dtype
  params/                   orbax PyTree checkpoint (OCDBT, uncompressed)

`save` builds the whole directory under a temporary name next to the target
and renames it into place only once orbax has committed and the JSON is
written, so a crash mid-save never leaves a checkpoint `restore` accepts.
`restore` reads every array straight into device memory at its stored shape
and dtype (taken from the JSON, so no orbax metadata pass is needed). Arrays
are stored without orbax's default zstd compression: weights barely compress,
and decompression slows restores.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp

from specjax.models import check_params
from specjax.models import Model
from specjax.models import ModelConfig
from specjax.models.config import flatten
from specjax.models.config import unflatten

FORMAT = "specjax-orbax"
VERSION = 1
META_NAME = "specjax_checkpoint.json"
PARAMS_NAME = "params"


def save(model: Model, directory: str | os.PathLike[str]) -> None:
  """Writes `model` to `directory`, replacing a specjax checkpoint there.

  Args:
    model: the model to save; its params must match `model.config`.
    directory: where to write. It may be absent (parents are created) or an
      existing specjax checkpoint, which is replaced only after the new one
      is complete.

  Raises:
    FileExistsError: `directory` exists and is not an empty directory or a
      specjax checkpoint (nothing else is ever deleted).
    ValueError: the params do not match the config.
  """
  params = model.canonical_params()
  check_params(model.config, params)
  directory = os.path.abspath(os.fspath(directory))
  if os.path.lexists(directory) and not (
      is_checkpoint(directory) or _is_empty_dir(directory)):
    raise FileExistsError(
        f"{directory!r} exists and is not a specjax checkpoint; refusing to "
        "overwrite it.")
  parent, base = os.path.split(directory)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
  try:
    with _checkpointer() as checkpointer:  # synchronous: returns committed
      checkpointer.save(os.path.join(tmp, PARAMS_NAME),
                        args=ocp.args.PyTreeSave(params))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "config": model.config.to_dict(),
        "dtypes": {path: np.dtype(x.dtype).name
                   for path, x in flatten(params).items()},
    }
    with open(os.path.join(tmp, META_NAME), "w") as f:
      json.dump(meta, f, indent=1)
    if os.path.lexists(directory):
      old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
      os.rename(directory, os.path.join(old, base))
      os.rename(tmp, directory)
      shutil.rmtree(old)
    else:
      os.rename(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def restore(directory: str | os.PathLike[str]) -> Model:
  """Reads a model written by `save`.

  Args:
    directory: a directory written by `save`.

  Returns:
    The model, parameters on the default device.

  Raises:
    FileNotFoundError: `directory` does not exist.
    ValueError: `directory` is not a (complete) specjax checkpoint.
  """
  directory = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"Checkpoint directory {directory!r} does not "
                            "exist.")
  if not is_checkpoint(directory):
    raise ValueError(f"{directory!r} is not a specjax checkpoint (no valid "
                     f"{META_NAME}); write one with specjax.checkpoints.save.")
  with open(os.path.join(directory, META_NAME)) as f:
    meta = json.load(f)
  if meta.get("version", 0) > VERSION:
    raise ValueError(f"{directory!r} is a version {meta['version']} specjax "
                     f"checkpoint; this specjax reads up to {VERSION}.")
  try:
    config = ModelConfig.from_dict(meta["config"])
    dtypes = {k: np.dtype(v) for k, v in meta["dtypes"].items()}
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{directory!r} has a corrupt {META_NAME}: {e!r}") from e
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def dtype(path):
    if path not in dtypes:
      raise ValueError(f"{META_NAME} in {directory!r} lacks the dtype of "
                       f"parameter {path!r}.")
    return dtypes[path]

  item = unflatten(config, lambda path, shape: jax.ShapeDtypeStruct(
      shape, dtype(path), sharding=sharding))
  restore_args = unflatten(config, lambda path, shape: ocp.ArrayRestoreArgs(
      sharding=sharding, global_shape=shape, dtype=dtype(path)))
  with _checkpointer() as checkpointer:
    params = checkpointer.restore(
        os.path.join(directory, PARAMS_NAME),
        args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
  check_params(config, params)
  return Model(config=config, params=params)


def is_checkpoint(directory: str | os.PathLike[str]) -> bool:
  """Whether `directory` holds a complete checkpoint written by `save`."""
  meta_path = os.path.join(directory, META_NAME)
  if not (os.path.isfile(meta_path)
          and os.path.isdir(os.path.join(directory, PARAMS_NAME))):
    return False
  try:
    with open(meta_path) as f:
      return json.load(f).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    return False


def _checkpointer() -> ocp.Checkpointer:
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _is_empty_dir(path: str) -> bool:
  return os.path.isdir(path) and not os.listdir(path)

