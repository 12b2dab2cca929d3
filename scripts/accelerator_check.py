r"""The accelerator check: decoding speed at real shapes, random weights.

Run through `scripts/accelerator_check.sh OUT_DIR` (which installs carried
wheels and bounds the time); `--tiny` runs the same code paths at tiny
shapes (CPU, under two minutes). No network, no model files: every model
has random weights at a real model's shapes (`specjax.testing.REAL_SHAPES`)
in `dtype="auto"` (bf16 on GPU/TPU, fp32 on CPU), and speculative runs
accept each draft token with a fixed probability α (synthetic acceptance,
`speculative_generate(synthetic_acceptance=α)`): label every figure
synthetic.

Measured per pair (Qwen2.5-Coder-1.5B with a 0.5B-shaped draft, then
Llama-3-8B with a 1B-shaped draft), most telling first, while the time
budget lasts:

- autoregressive decoding at B = 1 and 8: tokens/s, and the fraction of the
  HBM roofline: (weight bytes + KV-cache bytes read per step) / the
  device's bandwidth, over the measured step time;
- speculative decoding at B = 1 with the model draft, α = 0.6, 0.8, 0.9,
  γ = 4 and `gamma="auto"`, and prompt lookup at α = 0.8 (α is traced: one
  program per run kind);
- each program's first call: wall seconds over an identical second call,
  and the seconds JAX spent compiling (tracing, lowering, backend);
- XLA operations per decoding step (`profiling.executed_ops`; a kernel
  launch or more each on a GPU), at B = 1.

Everything goes to OUT_DIR/accelerator_check.json, rewritten after each
measurement, so a run cut short keeps what finished.

COMMAND: bash scripts/accelerator_check.sh /tmp/check      (a GPU or TPU)
COMMAND: bash scripts/accelerator_check.sh /tmp/check --tiny   (CPU smoke)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import models
from specjax import profiling
from specjax import testing

# Peak HBM bandwidth (bytes/s, vendor figures) by a substring of the device
# kind; elsewhere the roofline uses the bandwidth measured here.
_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
              ("A100", 2.0e12), ("L4", 3.0e11), ("T4", 3.2e11),
              ("TPU v5 lite", 8.19e11), ("TPU v4", 1.2e12),
              ("TPU v2", 7.0e11))
PAIRS = (("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
         ("llama-3-8b", "llama-3.2-1b"))
ALPHAS = (0.6, 0.8, 0.9)
GAMMA = 4


def tiny_config(name: str) -> models.ModelConfig:
  """A real model's config shrunk to test size, its architecture kept
  (biases, tied embeddings, rope scaling)."""
  return dataclasses.replace(
      testing.REAL_SHAPES[name], vocab_size=256, hidden_size=64,
      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=16)


def make_model(name: str, seed: int, tiny: bool) -> models.Model:
  config = tiny_config(name) if tiny else testing.REAL_SHAPES[name]
  return models.init_random(config, jax.random.key(seed), "auto")


def bandwidth() -> tuple[float, str]:
  """Device memory bandwidth in bytes/s, and where the figure is from."""
  kind = jax.devices()[0].device_kind
  for name, value in _BANDWIDTH:
    if name.lower() in kind.lower():
      return value, f"vendor peak for {kind}"
  x = jax.numpy.ones((1 << 24,), jax.numpy.float32)  # 64 MiB
  double = jax.jit(lambda a: a * 2.0)
  ms = hardware.median_ms({"copy": lambda: double(x)}, repeats=5)["copy"]
  return 2 * x.nbytes / (ms / 1e3), f"measured (read + write) on {kind}"


class Check:
  """Measurements written to one JSON file as they finish.

  Attributes:
    path: the JSON file.
    deadline: time.monotonic() past which measurements are skipped.
    record: what has been measured so far.
  """

  def __init__(self, path: str, budget_s: float, settings: dict[str, Any]):
    self.path = path
    self.deadline = time.monotonic() + budget_s
    self.record = {"machine": hardware.machine(),
                   "device_kind": jax.devices()[0].device_kind,
                   "settings": settings, "synthetic": True,
                   "results": [], "skipped": []}
    self._compile_s = [0.0]
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event: str, duration: float, **kwargs: Any) -> None:
    del kwargs
    if event.startswith("/jax/core/compile/"):
      self._compile_s[0] += duration

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def save(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.record, f, indent=1, default=float)
    os.replace(tmp, self.path)

  def add(self, name: str, need_s: float,
          measure: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """Runs `measure` if `need_s` seconds are left, records and saves."""
    if self.left() < need_s:
      self.record["skipped"].append(name)
      self.save()
      print(f"skipped {name}: {self.left():.0f} s left", flush=True)
      return None
    start = time.monotonic()
    try:
      result = {"name": name, **measure()}
    except Exception as e:  # pylint: disable=broad-except
      result = {"name": name, "error": f"{type(e).__name__}: {e}"}
    result["seconds"] = time.monotonic() - start
    self.record["results"].append(result)
    self.save()
    print(json.dumps(result, default=float), flush=True)
    return result

  def first_call(self, fn: Callable[[], Any]) -> dict[str, float]:
    """The first call's wall seconds over an identical second call, and
    the seconds spent compiling in it."""
    compiled, start = self._compile_s[0], time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    compiling = self._compile_s[0] - compiled
    start = time.perf_counter()
    jax.block_until_ready(fn())
    second = time.perf_counter() - start
    return {"first_call_s": first, "second_call_s": second,
            "first_call_overhead_s": first - second,
            "compile_s": compiling}


def decode_seconds(fn: Callable[[int], Any], tokens: int,
                   repeats: int) -> float:
  """Median seconds of fn(tokens) minus median of fn(1): the decoding
  steps alone, prefill excluded (calls interleaved)."""
  times = {tokens: [], 1: []}
  for _ in range(repeats):
    for n in (tokens, 1):
      start = time.perf_counter()
      jax.block_until_ready(fn(n).tokens)
      times[n].append(time.perf_counter() - start)
  return max(statistics.median(times[tokens]) - statistics.median(times[1]),
             1e-9)


def run_pair(check: Check, target_name: str, draft_name: str,
             args: argparse.Namespace, peak: float) -> None:
  """Every measurement of one (target, draft) pair."""
  target = make_model(target_name, 0, args.tiny)
  draft = make_model(draft_name, 1, args.tiny)
  tokens, prompt = args.tokens, args.prompt_tokens
  size = decode.default_cache_size(prompt, tokens, reserve=GAMMA + 2)
  common = dict(target=target_name, draft=draft_name,
                dtype=str(target.dtype), cache_size=size,
                new_tokens=tokens, prompt_tokens=prompt)
  base_tps = {}

  def generate_run(batch):
    prompts = testing.random_prompts(batch, target.vocab_size, prompt)
    return lambda n: decode.generate(target, prompts, max_new_tokens=n,
                                     cache_size=size)

  def autoregressive(batch):
    fn = generate_run(batch)
    out = check.first_call(lambda: fn(tokens).tokens)
    seconds = decode_seconds(fn, tokens, args.repeats)
    steps = tokens - 1
    c = target.config
    cache_bytes = (2 * c.num_layers * batch * size * c.num_kv_heads
                   * c.head_dim * target.dtype.itemsize)
    step_bytes = target.weight_bytes_per_token + cache_bytes
    base_tps[batch] = batch * steps / seconds
    out.update(common, batch=batch, tokens_per_s=base_tps[batch],
               ms_per_step=1e3 * seconds / steps,
               bytes_per_step=step_bytes,
               roofline_fraction=step_bytes / peak / (seconds / steps))
    if batch == 1:
      out["ops_per_step"] = profiling.ops_per_step(fn, tokens)
    return out

  def speculative(drafter, gamma, alphas, label):
    prompts = testing.random_prompts(1, target.vocab_size, prompt)
    def measure():
      make = lambda alpha: lambda n: decode.speculative_generate(
          target, drafter, prompts, gamma=gamma, max_new_tokens=n,
          cache_size=size, synthetic_acceptance=alpha, key=0)
      out = check.first_call(lambda: make(alphas[0])(tokens).tokens)
      out.update(common, batch=1, drafter=label, gamma=gamma, runs=[])
      for alpha in alphas:
        fn = make(alpha)
        seconds = decode_seconds(fn, tokens, args.repeats)
        result = fn(tokens)
        stats = result.stats
        tps = (tokens - 1) / seconds
        out["runs"].append({
            "alpha": alpha, "tokens_per_s": tps,
            "speedup": tps / base_tps[1] if base_tps.get(1) else None,
            # "auto" runs `generate` where no acceptance could pay
            # (`GammaPolicy.may_draft`): then no draft forward at all.
            "policy": result.policy or f"gamma={gamma}",
            "draft_forwards": int(np.sum(stats.draft_forwards)),
            "target_forwards": int(stats.target_forwards),
            "steps": int(stats.steps),
            "accepted": int(np.sum(stats.accepted_by_position)),
            "proposed": int(np.sum(stats.proposed_by_position))})
      out["ops_per_step"] = profiling.ops_per_step(make(alphas[-1]),
                                                   tokens)
      return out
    return measure

  need = args.need_s
  for batch in (1, 8):
    check.add(f"{target_name} autoregressive B={batch}", need,
              lambda b=batch: autoregressive(b))
  model_draft = drafters.DraftModel(draft)
  check.add(f"{target_name} speculative gamma={GAMMA}", need,
            speculative(model_draft, GAMMA, ALPHAS, draft_name))
  check.add(f"{target_name} prompt lookup gamma={GAMMA}", need,
            speculative(drafters.PromptLookup(vocab_size=target.vocab_size),
                        GAMMA, (0.8,), "prompt lookup"))
  check.add(f"{target_name} speculative auto", 2 * need,
            speculative(model_draft, "auto", ALPHAS, draft_name))


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out_dir", help="where accelerator_check.json goes")
  parser.add_argument("--tiny", action="store_true",
                      default=bool(os.environ.get("SPECJAX_CHECK_TINY")),
                      help="tiny shapes (CPU smoke run; env "
                      "SPECJAX_CHECK_TINY=1 too)")
  parser.add_argument("--budget_s", type=float, default=420.0,
                      help="stop starting measurements after this long")
  parser.add_argument("--need_s", type=float, default=None,
                      help="seconds a measurement needs to be started")
  parser.add_argument("--tokens", type=int, default=None)
  parser.add_argument("--prompt_tokens", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args(argv)
  defaults = dict(tokens=(12, 64), prompt_tokens=(16, 128), repeats=(2, 3),
                  need_s=(0.0, 45.0))
  for name, (tiny, real) in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, tiny if args.tiny else real)
  if args.tokens < 2:
    parser.error("--tokens must be >= 2 (steps are timed as N - 1).")
  os.makedirs(args.out_dir, exist_ok=True)
  peak, source = bandwidth()
  check = Check(os.path.join(args.out_dir, "accelerator_check.json"),
                args.budget_s, {**vars(args), "bandwidth": peak,
                                "bandwidth_source": source})
  for target_name, draft_name in PAIRS:
    run_pair(check, target_name, draft_name, args, peak)
  check.save()
  return check.record


if __name__ == "__main__":
  main()
