"""Chips to compile for with no chip attached, and their datasheets.

`jax.experimental.topologies.get_topology_desc` gives compile-only devices:

- TPU: of a TPU slice, once libtpu is installed (`pip install
  "specjax[tpu]"`) and told it runs alone (`environment`). libtpu reads that
  environment once per process, so each TPU kind is compiled for in a
  process of its own (`scripts/aot_report.py` runs one per chip).
- GPU: of CUDA devices described by a `GpuTargetConfigProto`, with jax >=
  0.12 (Python >= 3.12) and `jax[cuda12]`, in a process started with
  `JAX_PLATFORMS=cpu` (the CUDA plugin then registers its topology without
  looking for a GPU). The target config is read from the installed plugin,
  which embeds one per GPU model XLA knows (`gpu_target_config`). No
  autotuning happens without a device: Triton gemms keep default tiles.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import mmap
import os
import pathlib

import jax
from jax.experimental import topologies

from specjax.policies.costs import Roofline
from specjax.sharding import memory

__all__ = ["CHIPS", "Chip", "attached", "compiler", "devices", "environment",
           "gpu_target_config"]

_GPU_NEEDS = ("deviceless GPU compilation needs jax >= 0.12 (Python >= 3.12) "
              "with jax[cuda12]")
# The CUDA compilers jax installs (`jax[cuda12]`, `jax[cuda13]`):
# (distribution, the module that holds its shared library).
_CUDA_PLUGINS = (("jax-cuda12-pjrt", "jax_plugins.xla_cuda12"),
                 ("jax-cuda13-pjrt", "jax_plugins.xla_cuda13"))


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator model.

  Attributes:
    name: "v5e", "v6e" or "h100".
    accelerator_type: TPU: the `TPU_ACCELERATOR_TYPE` of a 4-chip host;
      GPU: the `device_description_str` of its XLA target config (the
      name CUDA gives the device).
    hbm_bytes: HBM per chip.
    bandwidth: HBM bytes per second per chip.
    bf16_flops: peak dense bf16 FLOP/s per chip.
    platform: "tpu" or "cuda".
  """

  name: str
  accelerator_type: str
  hbm_bytes: int
  bandwidth: float
  bf16_flops: float
  platform: str = "tpu"

  def topology(self, chips: int) -> str:
    """A topology holding `chips` chips: TPU (1, 4 or 8 chips): one 2x2
    host, or two; GPU: one host of `chips` GPUs (slices x hosts x
    devices)."""
    if self.platform == "cuda":
      return f"1x1x{chips}"
    return f"{self.name}:{'2x4' if chips > 4 else '2x2'}"


# The vendors' published figures per chip (Google Cloud; NVIDIA's H100 SXM
# datasheet: HBM3, dense bf16).
CHIPS = {
    "v5e": Chip("v5e", "v5litepod-4", 16 * 2**30, 819e9, 197e12),
    "v6e": Chip("v6e", "v6e-4", 32 * 2**30, 1640e9, 918e12),
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", 80 * 2**30, 3.35e12,
                 989e12, platform="cuda"),
}


def environment(chip: Chip) -> dict[str, str]:
  """The variables a process compiling for `chip` with no chip attached
  needs, set before JAX first loads its plugins: libtpu's for a TPU; for a
  GPU, JAX on its CPU alone (the CUDA plugin then skips its check for a
  GPU and still registers its topology)."""
  if chip.platform == "cuda":
    return {"JAX_PLATFORMS": "cpu"}
  return {"TPU_SKIP_MDS_QUERY": "1",
          "TPU_ACCELERATOR_TYPE": chip.accelerator_type,
          "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
          # No lock: other processes may hold libtpu (it compiles only).
          "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def _cuda_plugin() -> tuple[str, pathlib.Path] | None:
  """(distribution name, shared library) of the installed CUDA plugin."""
  for dist, module in _CUDA_PLUGINS:
    try:
      spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
      spec = None
    if spec is not None and spec.origin:
      library = pathlib.Path(spec.origin).parent / "xla_cuda_plugin.so"
      if library.exists():
        return dist, library
  return None


def gpu_target_config(chip: Chip) -> str:
  """The `GpuTargetConfigProto` text of `chip`, as the installed CUDA
  plugin embeds it (XLA's `backends/gpu/specs`; found by its
  `device_description_str`), so it always matches the compiler that reads
  it.

  Raises:
    RuntimeError: no CUDA plugin is installed, or it embeds no target
      config for `chip`.
  """
  plugin = _cuda_plugin()
  if plugin is None:
    raise RuntimeError(f"{_GPU_NEEDS}: no CUDA plugin is installed.")
  dist, library = plugin
  key = f'device_description_str: "{chip.accelerator_type}"\n'.encode()
  with open(library, "rb") as f, mmap.mmap(f.fileno(), 0,
                                           access=mmap.ACCESS_READ) as data:
    at = data.find(key)
    if at < 0:
      raise RuntimeError(
          f"{dist} {importlib.metadata.version(dist)} embeds no GPU target "
          f"config for {chip.accelerator_type!r}.")
    # One NUL-terminated string: comments, then the proto's fields.
    text = data[data.rfind(b"\0", 0, at) + 1:data.find(b"\0", at)]
  return text.decode()


def compiler(chip: Chip) -> str:
  """What compiles for `chip`: jax's version and its plugin's."""
  dist = "libtpu"
  if chip.platform == "cuda":
    plugin = _cuda_plugin()
    dist = plugin[0] if plugin else _CUDA_PLUGINS[0][0]
  try:
    plugin_version = importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    plugin_version = "not installed"
  return f"jax {jax.__version__}, {dist} {plugin_version}"


def _gpu_devices(chip: Chip, chips: int) -> list:
  """`chips` compile-only CUDA devices of `chip` (see the module's
  docstring for what they need)."""
  if jax.__version_info__ < (0, 12):
    raise RuntimeError(f"{_GPU_NEEDS}; this is jax {jax.__version__}.")
  config = gpu_target_config(chip)
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=config,
        topology=chip.topology(chips))
  except NotImplementedError as e:  # the plugin registered no topology
    raise RuntimeError(
        f"{_GPU_NEEDS}, in a process started with JAX_PLATFORMS=cpu "
        f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r} here; "
        f"{type(e).__name__}: {e}).") from e
  return list(topology.devices)


def devices(chip: Chip, chips: int) -> list:
  """`chips` compile-only devices of `chip`.

  Raises:
    RuntimeError: the chip's compiler is not installed (libtpu; for a GPU,
      jax >= 0.12 with jax[cuda12]), a GPU is asked for in a process not
      started with JAX_PLATFORMS=cpu, or the process's environment was set
      for another TPU.
  """
  if chip.platform == "cuda":
    return _gpu_devices(chip, chips)
  for key, value in environment(chip).items():
    os.environ.setdefault(key, value)
  if os.environ["TPU_ACCELERATOR_TYPE"] != chip.accelerator_type:
    raise RuntimeError(
        f"This process compiles for {os.environ['TPU_ACCELERATOR_TYPE']}; "
        f"compile for {chip.name} in a process of its own.")
  try:
    topology = topologies.get_topology_desc(
        topology_name=chip.topology(chips), platform="tpu")
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        "Compiling for TPU needs libtpu: pip install \"specjax[tpu]\" "
        f"({type(e).__name__}: {e}).") from e
  return list(topology.devices)[:chips]


def attached(chips: int = 1) -> tuple[Chip, list]:
  """This runtime's own first `chips` devices and a datasheet for them:
  their memory as JAX reports it, their nominal bandwidth and FLOP rate
  (`specjax.policies.Roofline.nominal`)."""
  devices = jax.devices()[:chips]
  nominal = Roofline.nominal()
  kind = devices[0].device_kind
  return Chip(kind, kind, memory.device_memory(devices[0]) or 0,
              nominal.bandwidth, nominal.flops), devices
