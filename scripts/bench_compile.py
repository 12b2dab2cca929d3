r"""How long a user waits for compilation: first call, new lengths, new process.

Loads the pair, then times speculative and autoregressive calls with
prompts of three lengths: the first call compiles; a second length in the
same power-of-two prompt bucket must reuse the program; a length in a new
bucket compiles one more. Run it twice: the second process finds the
programs in the persistent compilation cache.

COMMAND: python scripts/bench_compile.py   (then run it again)

Prints, per call, the wall time and the seconds XLA spent compiling
(`specjax.compilation`), and the number of programs compiled.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax

from specjax import compilation
from specjax import decode
from specjax import registry

_TARGET = flags.DEFINE_string("target", "qwen2.5-coder-1.5b-instruct", "")
_DRAFT = flags.DEFINE_string("draft", "qwen2.5-coder-0.5b-instruct", "")
_LENGTHS = flags.DEFINE_list("lengths", ["150", "190", "300"],
                             "Prompt lengths, one call each, in order.")
_TOKENS = flags.DEFINE_integer("tokens", 32, "max_new_tokens.")


def main(argv):
  del argv
  seconds = [0.0]
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: seconds.__setitem__(
          0, seconds[0] + duration) if event.startswith(
              "/jax/core/compile/") else None)
  start = time.perf_counter()
  target, tok = registry.load_pretrained(_TARGET.value)
  draft, _ = registry.load_pretrained(_DRAFT.value)
  print(f"cache dir {jax.config.jax_compilation_cache_dir}; loaded in "
        f"{time.perf_counter() - start:.1f} s", flush=True)
  text = tok.encode("def fibonacci(n):\n    " * 100)
  for name, run in (
      ("speculative", lambda p: decode.speculative_generate(
          target, draft, [p], gamma=4, max_new_tokens=_TOKENS.value)),
      ("autoregressive", lambda p: decode.generate(
          target, [p], max_new_tokens=_TOKENS.value))):
    for length in map(int, _LENGTHS.value):
      before, compiled = seconds[0], compilation.num_compiled()
      begin = time.perf_counter()
      run(text[:length])
      print(f"{name:14s} P={length:4d} (bucket "
            f"{decode.prompt_bucket(length)}): "
            f"{time.perf_counter() - begin:6.1f} s wall, "
            f"{seconds[0] - before:6.1f} s compiling, "
            f"{compilation.num_compiled() - compiled} program(s)", flush=True)


if __name__ == "__main__":
  app.run(main)
