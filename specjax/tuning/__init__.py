"""Measured choices that depend on the machine.

- `matmul`: which `MatmulPlan` makes a verification pass cost about one
  forward on this CPU.
- `cost`: forward times per model, batch and chunk length, and the
  speculative throughput they predict.
- `simulate`: a γ policy's mean throughput under the cost model and
  synthetic acceptance, without timing noise.
"""

from specjax.tuning import cost
from specjax.tuning import matmul
from specjax.tuning import simulate

__all__ = ["cost", "matmul", "simulate"]
