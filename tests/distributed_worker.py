"""One process of a two-process `jax.distributed` run on localhost.

Started twice by tests/test_distributed.py (process ids 0 and 1, one CPU
device each). Decodes the tiny shardable pair greedily over a global mesh
split on the batch (2x1) and on the model (1x2), and prints the tokens as
JSON; the test compares them with a one-process run.

Usage: python tests/distributed_worker.py COORDINATOR_ADDRESS PROCESS_ID
"""

from __future__ import annotations

import json
import sys

from specjax import decode
from specjax import sharding
from specjax import testing
from specjax.sharding import distributed

PROMPTS = [[5, 17, 3, 9, 200, 41, 7], [11, 2], [99, 98, 97, 96]]
N = 10


def decode_all(mesh=None) -> dict:
  target, draft = testing.tiny_pair(shardable=True)
  ar = decode.generate(target, PROMPTS, max_new_tokens=N, mesh=mesh)
  spec = decode.speculative_generate(target, draft, PROMPTS, gamma=3,
                                     max_new_tokens=N, mesh=mesh)
  return {"generate": ar.tokens.tolist(), "speculative": spec.tokens.tolist()}


def main() -> None:
  address, process_id = sys.argv[1], int(sys.argv[2])
  distributed.initialize(address, 2, process_id)
  out = {"process_count": __import__("jax").process_count()}
  for data, model in ((2, 1), (1, 2)):
    out[f"{data}x{model}"] = decode_all(
        sharding.make_mesh(data=data, model=model))
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
