"""Measured choices that depend on the machine.

- `matmul`: which `MatmulPlan` makes a verification pass cost about one
  forward on this CPU.
- `quantize`: whether a GGUF model's own blocks or its float weights are
  the faster model here (`quantize="auto"`).
- `cost`: forward times per model, batch and chunk length, and the
  speculative throughput they predict.
- `simulate`: a γ policy's mean throughput under the cost model and
  synthetic acceptance, without timing noise.
"""

from specjax.tuning import cost
from specjax.tuning import matmul
from specjax.tuning import quantize
from specjax.tuning import simulate

__all__ = ["cost", "matmul", "quantize", "simulate"]
