"""Measured choices that depend on the machine.

- `matmul`: which `MatmulPlan` makes a verification pass cost about one
  forward on this CPU.
- `cost`: forward times per model, batch and chunk length, and the
  speculative throughput they predict.
"""

from specjax.tuning import cost
from specjax.tuning import matmul

__all__ = ["cost", "matmul"]
