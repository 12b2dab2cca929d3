"""Compiles the programs users run for TPU and GPU chips, with none attached.

Each chip kind is compiled for in a process of its own, started with the
environment its compiler needs (`chips.environment`: libtpu reads its
environment once; the CUDA plugin compiles with JAX_PLATFORMS=cpu). Every
figure is compiled for the chip, not run. TPU (jax 0.10.2 with libtpu):

  pip install -e ".[tpu]"
  python scripts/aot_report.py --out=results/aot/report.json

GPU (an H100) needs jax >= 0.12 with jax[cuda12], hence Python >= 3.12, in
an environment of its own (docs/accelerators.md); --append keeps the TPU
rows:

  JAX_PLATFORMS=cpu python scripts/aot_report.py --append \
      --runs=h100:1:qwen1.5b:bf16,h100:8:llama70b:bf16

The batch crossover (`specjax.aot.crossover`: the decoding steps at each
B, priced by the roofline, estimated):

  python scripts/aot_report.py --crossover=v5e:1:llama8b:int8 \
      --out=results/aot/crossover_v5e1_llama8b_int8.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

from specjax import hardware
from specjax.aot import chips
from specjax.aot import crossover
from specjax.aot import report

_OUT = flags.DEFINE_string("out", "results/aot/report.json", "JSON rows.")
_RUNS = flags.DEFINE_list(
    "runs", ["v5e:1:qwen1.5b:bf16:full", "v5e:1:qwen1.5b:bf16:unrolled",
             "v5e:1:qwen1.5b:int8", "v5e:1:llama8b:bf16",
             "v5e:1:llama8b:int8", "v5e:1:llama8b:int8:unrolled",
             "v6e:1:qwen1.5b:bf16", "v6e:1:qwen1.5b:int8",
             "v6e:1:llama8b:bf16", "v6e:1:llama8b:int8",
             "v6e:8:llama70b:bf16",
             "v5e:8:llama70b:int8",
             "v5e:8:mixtral8x7b:bf16:steps",
             "v5e:8:mixtral8x7b:bf16:unrolled:steps",
             "v5e:8:qwen3-30b-a3b:bf16:steps",
             "v5e:8:qwen3-30b-a3b:bf16:unrolled:steps"],
    "chip:chips:pair:weights[:full|:unrolled][:steps] runs (steps: the "
    "decoding steps alone, report.STEPS).")
_ONE = flags.DEFINE_string("one", "", "Internal: run one entry of --runs.")
_APPEND = flags.DEFINE_bool(
    "append", False, "Keep --out's rows of runs not in --runs.")
_CROSSOVER = flags.DEFINE_string(
    "crossover", "", "chip:chips:pair:weights: compile the decoding steps "
    "at each of --batches instead of --runs (specjax.aot.crossover).")
_BATCHES = flags.DEFINE_list(
    "batches", [str(b) for b in crossover.BATCHES], "B of --crossover.")
_TABLES = flags.DEFINE_string(
    "tables", "", "Print the markdown tables of this report JSON and exit.")


def _one(spec: str) -> list[dict]:
  chip, chips, pair, weights, *extra = spec.split(":")
  quantize = None if weights == "bf16" else weights
  if _CROSSOVER.value:
    return crossover.run(chip, pair, chips=int(chips), quantize=quantize,
                         batches=[int(b) for b in _BATCHES.value])
  only = (("generate step", "generate", "model γ=4 step", "model γ=4")
          if "unrolled" in extra else ())
  if "steps" in extra:
    only = report.STEPS
  return report.run(chip, pair, chips=int(chips),
                    quantize=quantize,
                    scan="unrolled" not in extra, full="full" in extra,
                    only=only)


def main(argv):
  del argv
  if _ONE.value:
    print(json.dumps(_one(_ONE.value)))
    return
  if _TABLES.value:
    with open(_TABLES.value) as f:
      rows = json.load(f)["rows"]
    print((crossover if "batch" in rows[0] else report).markdown(rows))
    return
  rows = []
  for spec in [_CROSSOVER.value] if _CROSSOVER.value else _RUNS.value:
    print(f"compiling {spec} ...", file=sys.stderr, flush=True)
    env = chips.environment(chips.CHIPS[spec.split(":")[0]])
    out = subprocess.run([sys.executable, __file__, f"--one={spec}",
                          f"--crossover={_CROSSOVER.value}",
                          f"--batches={','.join(_BATCHES.value)}"],
                         capture_output=True, text=True, check=False,
                         env={**os.environ, "JAX_PLATFORMS": "", **env})
    if out.returncode:
      print(out.stderr[-3000:], file=sys.stderr)
      continue
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for row in got:
      print(json.dumps(row), flush=True)
    rows += got
  if _APPEND.value and os.path.exists(_OUT.value):
    key = lambda r: (r["chip"], r["pair"], r["weights"], r["layout"],
                     r["program"])
    new = {key(r) for r in rows}
    with open(_OUT.value) as f:
      old = json.load(f)
    # Reports before rows named their compiler held one for all rows.
    before = (f"jax {old['jax']}, libtpu {old['libtpu']}"
              if "libtpu" in old else None)
    rows = [dict(r, compiler=r.get("compiler", before))
            for r in old["rows"] if key(r) not in new] + rows
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump({"machine": hardware.machine(),
               "compilers": sorted({r["compiler"] for r in rows
                                    if r.get("compiler")}),
               "rows": rows}, f, indent=1)
  print((crossover if _CROSSOVER.value else report).markdown(rows))


if __name__ == "__main__":
  app.run(main)
