"""Checkpoints: Hugging Face safetensors, GGUF, orbax and native -> `Model`.

Every loader returns a `specjax.models.Model` (config plus params laid out as
`specjax.models.param_shapes`). Nothing is ever unpickled.
"""

from specjax.checkpoints import native
from specjax.checkpoints.hf import load_hf
from specjax.checkpoints.gguf import load_gguf
from specjax.checkpoints.orbax_io import restore, save

__all__ = ["load_gguf", "load_hf", "native", "restore", "save"]
