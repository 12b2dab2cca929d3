r"""Target pass cost against the number of tokens scored per row.

A chain of γ drafts is verified in a pass of γ + 1 tokens, a token tree of
T nodes in a pass of T + 1 (`specjax.tree`). This times one jitted forward
of each width after a prefill (`specjax.tuning.cost.measure`: median of
`--repeats`, cached per machine) and prints ms and the ratio to one token.

COMMAND: python scripts/bench_verify_width.py \
  --model=qwen2.5-coder-1.5b-instruct --nodes=1/4/8/16/32/64 \
  [--quantize=gguf:a8]
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax

from specjax import hardware
from specjax import registry
from specjax import testing
from specjax.tuning import cost

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-1.5b-instruct",
                             "Registry name, path, or 'tiny'.")
_NODES = flags.DEFINE_string("nodes", "1/4/8/16/32/64",
                             "Draft tokens (chain length or tree nodes).")
_BATCH = flags.DEFINE_integer("batch", 1, "Rows B.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per width.")
_QUANTIZE = flags.DEFINE_string(
    "quantize", None, "As load_pretrained's: gguf, gguf:a8, int8, int4.")


def main(argv):
  del argv
  if _MODEL.value == "tiny":
    model, _ = testing.tiny_pair()
  else:
    model, _ = registry.load_pretrained(_MODEL.value, progress=False,
                                        quantize=_QUANTIZE.value)
  nodes = [int(x) for x in _NODES.value.split("/") if x]
  costs = cost.measure(model, batch=_BATCH.value,
                       chunks=[1] + [n + 1 for n in nodes],
                       repeats=_REPEATS.value, refresh=True)
  one = costs.at(1)
  print(f"{_MODEL.value} ({_QUANTIZE.value or 'float'}), B={_BATCH.value}, "
        f"plan {getattr(model.plan, 'name', '')}; {hardware.machine()}; "
        f"jax {jax.__version__}")
  print("nodes | tokens | ms | / one token")
  print(f"0 | 1 | {one:.1f} | 1.00")
  for n in nodes:
    ms = costs.at(n + 1)
    print(f"{n} | {n + 1} | {ms:.1f} | {ms / one:.2f}")
  print(json.dumps({str(n + 1): costs.at(n + 1) for n in [0] + nodes}))


if __name__ == "__main__":
  app.run(main)
