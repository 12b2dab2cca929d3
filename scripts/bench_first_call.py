r"""Issue 54's compile-time bar: a first call's overhead over identical calls.

Loads the real pair (Qwen2.5-Coder 1.5B target, 0.5B draft, fp32 on CPU),
then makes the same call three times per API in this fresh process, with
no persistent compilation cache: a 150-token prompt, N = 64, `generate`,
and `speculative_generate` with the draft model at γ = 4 (`spec`) and at
`gamma="auto"` (`auto`). Prints each
call's wall time and backend-compile seconds, and the overhead (first call
minus the faster later one).

`unrolled` first in the arguments compiles every layer of every forward,
as specjax did before the layer loop (`MatmulPlan.layer_loop=False`), for
a before-and-after in one session.

`quantize=gguf` (or gguf:a8, int8, int4) last loads both models with
`load_pretrained(quantize=...)`.

COMMAND: python scripts/bench_first_call.py [unrolled] [generate] [spec] [auto] [quantize=...]
  (XLA_FLAGS=--xla_backend_optimization_level=0 to compare LLVM -O0)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

os.environ["SPECJAX_NO_COMPILE_CACHE"] = "1"

import jax  # pylint: disable=g-import-not-at-top

from specjax import decode  # pylint: disable=g-import-not-at-top
from specjax import registry  # pylint: disable=g-import-not-at-top

_BACKEND = "/jax/core/compile/backend_compile_duration"


def main(which: list[str]) -> None:
  seconds = [0.0]
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: seconds.__setitem__(
          0, seconds[0] + duration) if event == _BACKEND else None)
  start = time.perf_counter()
  quantize = None
  if which[-1:] and which[-1].startswith("quantize="):
    quantize = which.pop().partition("=")[2]
  target, tok = registry.load_pretrained("qwen2.5-coder-1.5b-instruct",
                                         quantize=quantize)
  draft, _ = registry.load_pretrained("qwen2.5-coder-0.5b-instruct",
                                      quantize=quantize)
  print("loaded in", round(time.perf_counter() - start, 1), "s; weights",
        quantize or "fp32", flush=True)
  mode = "layer loop"
  if which[:1] == ["unrolled"]:
    which, mode = which[1:], "unrolled"
    target, draft = (m.with_plan(dataclasses.replace(m.plan, layer_loop=False))
                     for m in (target, draft))
  print("plans:", target.plan.name, draft.plan.name, mode, flush=True)
  prompt = tok.encode("def fibonacci(n):\n    " * 100)[:150]
  runs = {
      "generate": lambda: decode.generate(target, [prompt],
                                          max_new_tokens=64),
      "spec": lambda: decode.speculative_generate(
          target, draft, [prompt], gamma=4, max_new_tokens=64),
      "auto": lambda: decode.speculative_generate(
          target, draft, [prompt], gamma="auto", max_new_tokens=64)}
  for name in which or list(runs):
    times = []
    for _ in range(3):
      begin, compiled = time.perf_counter(), seconds[0]
      runs[name]()
      times.append((time.perf_counter() - begin, seconds[0] - compiled))
    print(name, mode, os.environ.get("XLA_FLAGS", "default flags"),
          "calls (wall s, backend compile s):",
          [(round(a, 1), round(c, 1)) for a, c in times], "overhead",
          round(times[0][0] - min(t for t, _ in times[1:]), 1), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
