"""The CPU wing: native kernels, the matmul plans that use them, and the
choices measured once per machine.

- `kernels`: the few-row products of `smallm.cc`, built on first use;
- `matmul`: `SMALLM`, those kernels as a plan's `MatmulKernel`, and
  `plan(name)`, a `MatmulPlan` from its name;
- `plans`: which plan this machine runs a model's products fastest with;
- `quantize`: what `quantize="auto"` loads, a GGUF file's own blocks or
  its float weights.

The model reaches these only through a plan's kernel
(`specjax.models.MatmulKernel`); the engine imports nothing from here.
The loaders (`specjax.registry`, `specjax.tune`, `specjax.testing`) choose
a plan here and hand it to the model (`tests/test_cpu_wing.py`).
"""

from specjax.cpu import kernels
from specjax.cpu import matmul
from specjax.cpu import plans
from specjax.cpu import quantize
from specjax.cpu.matmul import plan
from specjax.cpu.matmul import SMALLM

__all__ = ["SMALLM", "kernels", "matmul", "plan", "plans", "quantize"]
