r"""Issue 57's window-sized reads: decoding Gemma 3 270M from a long cache.

A local (sliding-window) layer reads only its window's W slots of the
cache once the cache holds 2W (`specjax.models.transformer.window_start`);
before, it read all S slots and masked the rest. This loads Gemma 3 270M
(offline GGUF, fp32) and, for each cache size S, times `generate` (B = 1,
a 64-token prompt, N new tokens, the median of 3 warm calls) with window
reads and with full reads (`window_start` patched to return None). Prints
one JSON line per S: ms per token for each and their ratio, plus the KV
bytes each decode step reads.

COMMAND: python scripts/bench_window.py [--sizes=1024,4096,16384] [--tokens=32]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np

from specjax import decode
from specjax import hardware
from specjax import registry
from specjax.models import transformer


def _ms_per_token(target, prompt, size: int, tokens: int) -> float:
  def call():
    return decode.generate(target, [prompt], max_new_tokens=tokens,
                           cache_size=size)
  call()  # compile
  times = []
  for _ in range(3):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times) / tokens


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--sizes", default="1024,4096,16384")
  parser.add_argument("--tokens", type=int, default=32)
  args = parser.parse_args()
  target, tok = registry.load_pretrained("gemma-3-270m")
  c = target.config
  prompt = tok.encode("def fibonacci(n):\n    " * 40)[:64]
  local = sum(c.is_local(i) for i in range(c.num_layers))
  slot_bytes = (2 * c.num_kv_heads * c.head_dim
                * np.dtype(target.dtype).itemsize)  # keys and values
  window_read = transformer.window_start
  print(json.dumps({"cpu": hardware.cpu_id(), "jax": jax.__version__,
                    "python": platform.python_version(),
                    "model": "gemma-3-270m fp32", "window": c.sliding_window,
                    "local_layers": local, "layers": c.num_layers,
                    "weight_bytes": target.weight_bytes_per_token}),
        flush=True)
  def reads(window_reads: bool) -> None:
    transformer.window_start = (window_read if window_reads
                                else lambda *args: None)
    jax.clear_caches()  # trace again with the other attention

  for size in (int(s) for s in args.sizes.split(",")):
    reads(window_reads=True)
    windowed = _ms_per_token(target, prompt, size, args.tokens)
    reads(window_reads=False)
    full = _ms_per_token(target, prompt, size, args.tokens)
    reads(window_reads=True)
    slots = c.sliding_window if size >= 2 * c.sliding_window else size
    print(json.dumps({
        "cache_size": size, "ms_per_token_window_reads": round(windowed, 2),
        "ms_per_token_full_reads": round(full, 2),
        "full_over_window": round(full / windowed, 3),
        "kv_bytes_per_step_window_reads": slot_bytes * (
            local * slots + (c.num_layers - local) * size),
        "kv_bytes_per_step_full_reads": slot_bytes * c.num_layers * size}),
        flush=True)


if __name__ == "__main__":
  main()
