r"""Peer benchmark: Hugging Face transformers on the same weights and prompts.

Runs the experiment config's prompts (encoded with specjax's tokenizer, so
both sides see identical ids) through `transformers` `generate`: plain
autoregressive decoding of the target, and assisted generation
(`assistant_model=draft`, `num_assistant_tokens=γ`, constant schedule, the
draft confidence threshold set to `config.draft_stop_threshold`). Registry
models load from the same GGUF files specjax uses
(`from_pretrained(dir, gguf_file=...)`, dequantized); other names load as
Hugging Face checkpoints. Same dtype; torch uses as many threads as XLA
(the cores this process may run on) unless `--threads` says otherwise.

Writes the same result fields as `experiments.run` to
`<output_dir>/results.json` and prints a comparison with specjax's
`results.json` when `--specjax_results` is given.

COMMAND: python scripts/bench_hf.py --config=configs/llama_pair.py \
  --specjax_results=/tmp/specjax/llama_pair/qwen/results.json

Caveats: transformers' assisted generation runs one row at a time (B = 1);
it does not expose acceptance counts, so α and τ are derived from counted
target forwards (τ = new tokens / target forwards; α ≈ (τ - 1) / γ) and
per-position acceptance is not available.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import bench
from experiments import pair
from experiments import report
from specjax import hardware
from specjax import metrics

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/llama_pair.py", "Experiment config file.",
    lock_config=True)
_SPECJAX = flags.DEFINE_string(
    "specjax_results", None, "specjax results.json to compare against.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Where to write results.json (default "
    "<config.output_dir>/hf).")
_THREADS = flags.DEFINE_integer(
    "threads", 0, "torch threads; 0 matches XLA (the usable cores).")
_MODES = flags.DEFINE_list(
    "modes", ["baseline", "assisted", "lookup"],
    "Which runs: baseline, assisted (draft model), lookup (prompt lookup).")
_LOOKUP_NGRAM = 3  # transformers' max_matching_ngram_size, as specjax's


def load_model(name: str, dtype: Any, cache_dir: str | None):
  """A transformers causal LM from a registry name, .gguf file, dir or id."""
  import transformers  # pylint: disable=g-import-not-at-top
  from specjax import weights  # pylint: disable=g-import-not-at-top

  kwargs = {}
  if name in weights.SOURCES:
    path = weights.fetch(name, cache_dir, progress=False)
    source, kwargs["gguf_file"] = str(path.parent), path.name
  elif name.endswith(".gguf"):
    path = pathlib.Path(name).expanduser()
    source, kwargs["gguf_file"] = str(path.parent), path.name
  else:
    source = name
  model = transformers.AutoModelForCausalLM.from_pretrained(
      source, dtype=dtype, **kwargs)
  return model.eval()


def load_tokenizer(name: str, cache_dir: str | None):
  from specjax import registry  # pylint: disable=g-import-not-at-top
  return registry.load_tokenizer(name, cache_dir)


class _Counter:
  """Counts forward calls of a module through a forward hook."""

  def __init__(self, module):
    self.calls = 0
    self._handle = module.register_forward_hook(self._hook)

  def _hook(self, *args):
    del args
    self.calls += 1

  def remove(self):
    self._handle.remove()


def forward_ms(model, input_ids, repeats: int) -> float:
  """Median ms of a one-token forward after prefilling `input_ids`."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.inference_mode():
    out = model(input_ids, use_cache=True)
    past = out.past_key_values
    token = input_ids[:, -1:]
    times = []
    for i in range(repeats + 2):
      start = time.perf_counter()
      out = model(token, past_key_values=past, use_cache=True)
      if i >= 2:  # two warm-up calls
        times.append(time.perf_counter() - start)
      past = out.past_key_values  # grows by one token per call
  return 1e3 * statistics.median(times)


def generation_config(config, eos_ids, pad_id):
  import transformers  # pylint: disable=g-import-not-at-top
  sample = config.temperature > 0
  return transformers.GenerationConfig(
      max_new_tokens=config.max_new_tokens, do_sample=sample,
      temperature=config.temperature if sample else None,
      top_k=config.top_k if sample else None,
      top_p=config.top_p if sample else None,
      eos_token_id=None if config.ignore_eos else list(eos_ids),
      pad_token_id=pad_id)


def run(config, specjax_path: str | None, output_dir: str,
        threads: int, modes: list[str]) -> dict[str, Any]:
  """Runs baseline and/or assisted generation; returns the result dict."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  bench.validate_config(config)
  if config.target == "tiny":
    raise app.UsageError("config.target='tiny' has no transformers "
                         "counterpart; use a real pair.")
  torch.set_num_threads(threads)
  torch.manual_seed(config.seed)
  dtype = {"auto": torch.float32, "float32": torch.float32,
           "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]
  cache_dir = config.cache_dir or None
  gamma = config.gamma
  start = time.perf_counter()
  tokenizer = load_tokenizer(config.target, cache_dir)
  prompt_set, encoded = pair.encode_prompts(config, tokenizer)
  target = load_model(config.target, dtype, cache_dir)
  draft = None
  if "assisted" in modes:
    draft = (target if config.draft == "same"
             else load_model(config.draft, dtype, cache_dir))
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = (
        config.draft_stop_threshold)
  load_s = time.perf_counter() - start
  pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (
      tokenizer.eos_ids[0])
  gen_config = generation_config(config, tokenizer.eos_ids, pad_id)

  def generate(ids, mode: str):
    inputs = torch.tensor([ids], dtype=torch.long)
    kwargs = {"baseline": {}, "assisted": {"assistant_model": draft},
              "lookup": {"prompt_lookup_num_tokens": gamma,
                         "max_matching_ngram_size": _LOOKUP_NGRAM}}[mode]
    with torch.inference_mode():
      begin = time.perf_counter()
      out = target.generate(inputs, attention_mask=torch.ones_like(inputs),
                            generation_config=gen_config, **kwargs)
      seconds = time.perf_counter() - begin
    return out[0, len(ids):].tolist(), seconds

  # Warm-up (allocations, lazy init): not timed.
  first = torch.tensor([encoded[0]], dtype=torch.long)
  with torch.inference_mode():
    short = generation_config(config, tokenizer.eos_ids, pad_id)
    short.max_new_tokens = 2
    target.generate(first, attention_mask=torch.ones_like(first),
                    generation_config=short)
    if draft is not None:
      target.generate(first, attention_mask=torch.ones_like(first),
                      generation_config=short, assistant_model=draft)

  cost = {}
  if draft is not None:
    draft_ms = forward_ms(draft, first, config.cost_repeats)
    target_ms = forward_ms(target, first, config.cost_repeats)
    cost = {"draft_forward_ms": draft_ms, "target_forward_ms": target_ms,
            "draft_cost_ratio": draft_ms / target_ms}

  rows = []
  for prompt, ids in zip(prompt_set.prompts, encoded):
    row = {"id": prompt.id, "prompt_tokens": len(ids)}
    if "baseline" in modes:
      base, row["baseline_time_s"] = generate(ids, "baseline")
      row["baseline_tokens"] = len(base)
      row["baseline_tokens_per_s"] = len(base) / row["baseline_time_s"]
      row["baseline_ids"] = base
    # "spec" is assisted generation (the draft model); "lookup" is prompt
    # lookup. Both count target forwards to derive τ.
    for mode, prefix in (("assisted", "spec"), ("lookup", "lookup")):
      if mode not in modes:
        continue
      counter = _Counter(target)
      out, row[f"{prefix}_time_s"] = generate(ids, mode)
      counter.remove()
      row[f"{prefix}_tokens"] = len(out)
      row[f"{prefix}_tokens_per_s"] = len(out) / row[f"{prefix}_time_s"]
      row[f"{prefix}_target_forwards"] = counter.calls
      if mode == "assisted":
        row["target_forwards"] = counter.calls
        row["mean_accepted_tokens"] = len(out) / max(counter.calls, 1)
        row["acceptance_rate"] = (row["mean_accepted_tokens"] - 1) / gamma
        row["completion_ids"] = out
      if "baseline" in modes and config.temperature == 0:
        row["lossless" if mode == "assisted" else "lookup_lossless"] = (
            out == base)
    rows.append(row)
    print(f"{prompt.id}: " + ", ".join(
        f"{k}={row[k]:.2f}" for k in ("baseline_tokens_per_s",
                                      "spec_tokens_per_s",
                                      "lookup_tokens_per_s") if k in row),
          flush=True)

  def total(kind):
    tokens = sum(r.get(f"{kind}_tokens", 0) for r in rows)
    seconds = sum(r.get(f"{kind}_time_s", 0.0) for r in rows)
    return tokens / seconds if seconds else None

  base_tps, spec_tps = total("baseline"), total("spec")
  lookup_tps = total("lookup")
  results = {
      "implementation": f"transformers {transformers.__version__}, torch "
                        f"{torch.__version__}",
      "baseline_tokens_per_s": base_tps,
      "spec_tokens_per_s": spec_tps,
      "speedup": spec_tps / base_tps if base_tps and spec_tps else None,
      "gamma": gamma,
      "batch_size": 1,
      "lookup_tokens_per_s": lookup_tps,
      "lookup_speedup": (lookup_tps / base_tps if base_tps and lookup_tps
                         else None),
      "lookup_mean_accepted_tokens": (
          sum(r.get("lookup_tokens", 0) for r in rows)
          / max(sum(r.get("lookup_target_forwards", 0) for r in rows), 1)
          if "lookup" in modes else None),
      "lookup_lossless": (all(r["lookup_lossless"] for r in rows)
                          if rows and "lookup_lossless" in rows[0] else None),
      "per_position_acceptance": None,  # not exposed by transformers
      "lossless": (all(r["lossless"] for r in rows)
                   if rows and "lossless" in rows[0] else None),
      "per_prompt": rows,
      "config": config.to_dict(),
      "device": {"platform": "cpu", "torch_threads": torch.get_num_threads(),
                 "cpu_cores": hardware.num_cores(), "dtype": str(dtype)},
      "prompts": {"set": prompt_set.name, "source": prompt_set.source,
                  "count": len(encoded), "tokens": [len(p) for p in encoded],
                  "chat_template": config.chat_template},
      "timing": {"load_s": load_s, "total_s": time.perf_counter() - start},
  }
  if draft is not None:
    forwards = sum(r["target_forwards"] for r in rows)
    tau = sum(r["spec_tokens"] for r in rows) / max(forwards, 1)
    alpha = min(max((tau - 1) / gamma, 0.0), 1.0)
    results.update(
        acceptance_rate=alpha, mean_accepted_tokens=tau, **cost,
        predicted_speedup=metrics.predicted_speedup(
            alpha, gamma, cost["draft_cost_ratio"]))

  if specjax_path:
    specjax = json.loads(pathlib.Path(specjax_path).read_text())
    results["specjax_results"] = specjax_path
    agree = _agreement(specjax, rows)
    if agree is not None:
      results["same_ids_as_specjax"] = agree
    print(comparison_table(specjax, results))
  report.write_results(results, output_dir)
  print(f"wrote {os.path.join(output_dir, report.RESULTS_FILE)}")
  return results


def _agreement(specjax: dict[str, Any], rows) -> str | None:
  """`k/n` prompts whose greedy ids equal specjax's (same prompt ids)."""
  theirs = {p["id"]: p.get("completion_ids")
            for p in specjax.get("per_prompt", [])}
  pairs = [(theirs.get(r["id"]), r.get("completion_ids", r.get(
      "baseline_ids"))) for r in rows]
  pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
  if not pairs:
    return None
  return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def comparison_table(specjax: dict[str, Any], hf: dict[str, Any]) -> str:
  """specjax vs transformers, field by field."""
  fields = [
      ("baseline tokens/s", "baseline_tokens_per_s", ".2f"),
      ("speculative tokens/s", "spec_tokens_per_s", ".2f"),
      ("speedup", "speedup", ".2f"),
      ("prompt-lookup tokens/s", "lookup_tokens_per_s", ".2f"),
      ("prompt-lookup speedup", "lookup_speedup", ".2f"),
      ("predicted speedup", "predicted_speedup", ".2f"),
      ("α acceptance rate", "acceptance_rate", ".3f"),
      ("τ tokens per target call", "mean_accepted_tokens", ".2f"),
      ("c draft cost ratio", "draft_cost_ratio", ".3f"),
      ("draft forward ms", "draft_forward_ms", ".1f"),
      ("target forward ms", "target_forward_ms", ".1f"),
      ("lossless (greedy)", "lossless", ""),
      ("γ", "gamma", ""),
      ("batch size", "batch_size", ""),
  ]
  cost = specjax.get("cost", {}).get(str(specjax.get("batch_size")), {})

  def value(results, key, spec):
    v = results.get(key, cost.get(key) if results is specjax else None)
    if v is None:
      return "-"
    return f"{v:{spec}}" if spec and isinstance(v, (int, float)) else str(v)

  rows = [(label, value(specjax, k, s), value(hf, k, s))
          for label, k, s in fields]
  if "same_ids_as_specjax" in hf:
    rows.append(("greedy ids equal specjax's", "", hf["same_ids_as_specjax"]))
  return "\n" + report.table(["", "specjax", "transformers"], rows)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  output_dir = _OUTPUT_DIR.value or os.path.join(config.output_dir, "hf")
  threads = _THREADS.value or hardware.num_cores()
  run(config, _SPECJAX.value, output_dir, threads,
      _MODES.value)


if __name__ == "__main__":
  app.run(main)
