"""The tuning step behind `gamma="auto"`: measure once, cache, on any
backend (`python -m specjax.tune`).

- `cost`: forward times per model, batch, cache size and chunk length;
- `machine`: the machine's memory bandwidth and matmul rate.

Calls only read what these wrote (`specjax.policies.measured`). The
CPU-only choices (matmul plans, `quantize="auto"`) are the CPU wing's,
`specjax.cpu`.
"""

from specjax.tuning import cost
from specjax.tuning import machine

__all__ = ["cost", "machine"]
