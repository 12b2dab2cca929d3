"""Baseline vs speculative decoding on one prompt set: the experiment library.

`run_experiment(config)` is what `experiments/run.py` calls and what a
notebook can call: it validates the config, loads the pair and tokenizer,
encodes the prompts, measures the draft cost ratio c, runs the autoregressive
baseline and speculative decoding on the same prompts for every (batch size,
γ) of the sweep, and returns a JSON-ready dict (`experiments.report` prints
and writes it).

Shape letters (`specjax.shapes`): B batch, P padded prompt bucket, S cache
size, T tokens per forward, N max new tokens, G = γ.

Timing. Every generate call is one compiled program per shape (B, P, S, N,
γ). All calls share one S, and before a shape is timed it runs once untimed
with the same prompts (the warm-up), so compilation never lands in a timed
region. tokens/s counts generated tokens (EOS included) over wall time,
summed over the batches; with B > 1 all rows of a batch share its time.

The cost ratio c (`experiments.cost`) is measured per batch size on the
first batch's rows; the predicted speedup uses the measured α and that c.

Generation controls (stop strings, penalties, logit bias, min-p, a regex or
JSON schema; `generation_controls`) apply to the baseline and every
speculative run alike, with the pair's tokenizer. Each speculative run has
an acceptance rule (`config.acceptances`): a lossy one (typical, relaxed)
marks the run `lossy` and never `lossless`. Where the config scores
completions (`experiments.quality`: a schema's validity rate, a regex,
HumanEval pass@1), the baseline and every run are scored alike.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import controls as controls_lib
from experiments import cost as cost_lib
from experiments import learned
from experiments import prompts as prompts_lib
from experiments import quality
from experiments import report
from experiments.pair import drafter_names
from experiments.pair import encode_prompts
from experiments.pair import load_pair
from experiments.pair import make_drafter
from experiments.pair import matmul_info
from experiments.pair import memory_plan
from experiments.pair import model_info
from experiments.pair import Pair
from experiments.validation import acceptance_kwargs
from experiments.validation import acceptance_names
from experiments.validation import ConfigError
from experiments.validation import is_tree_drafter
from experiments.validation import parse_acceptance
from experiments.validation import validate_config
from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import heads
from specjax import metrics
from specjax import policies
from specjax import progress as progress_lib
from specjax.hardware import timed_call
from specjax.sharding import distributed
from specjax.tuning import cost as tuning_cost

__all__ = ["ConfigError", "Pair", "jax_cache_dir", "load_pair",
           "run_and_save", "run_experiment", "validate_config"]

_TEXT_CHARS = 2000  # completion text kept per prompt in results.json


def drafter_cost_ratio(drafter: Any, pair: Pair, cost: dict[str, Any],
                       batch: Sequence[Sequence[int]], cache_size: int,
                       repeats: int) -> float:
  """c of the model whose forward each drafted token costs: the pair's
  draft (measured in `cost`), a self-drafter's layers (measured here
  against the target), Medusa heads (their one pass per step), an EAGLE
  layer (one step per token), or 0 for a drafter without a model."""
  if isinstance(drafter, (heads.Medusa, heads.Eagle)):
    # Medusa: one pass of the heads and the shared LM head proposes all K
    # tokens; EAGLE: one layer step and the LM head per drafted token.
    rows = len(batch)
    hidden = jnp.zeros((rows, 1, pair.target.config.hidden_size),
                       pair.target.dtype)
    if isinstance(drafter, heads.Medusa):
      pass_ = jax.jit(lambda d, h: d.logits(h))
    else:
      state = drafter.init(jnp.ones((rows, 1), jnp.int32),
                           jnp.ones((rows,), jnp.int32),
                           jnp.ones((rows,), jnp.int32), cache_size,
                           prompt_hidden=hidden)
      pass_ = jax.jit(lambda d, h: d.target.logits(d.step(
          h, jnp.zeros(h.shape[:2], jnp.int32), state.cache)[0]))
    ms = hardware.median_ms({"heads": lambda: pass_(drafter, hidden),
                    "target": cost_lib.forward_step(pair.target, batch,
                                                    cache_size, 1)}, repeats)
    return ms["heads"] / ms["target"]
  model = drafter.cost_model
  if model is None:
    return 0.0
  if model is pair.draft:
    return cost["draft_cost_ratio"]
  return cost_lib.measure_cost(pair.target, model, batch, cache_size, (),
                               repeats)["draft_cost_ratio"]


def jax_cache_dir(config: Any) -> str | None:
  """The persistent compilation cache directory `config.jax_cache_dir` names.

  `auto` is `<cache>/xla_cache` under `config.cache_dir`, else
  `$SPECJAX_CACHE`, else ~/.cache/specjax; '' is None (no cache).
  """
  if not config.jax_cache_dir:
    return None
  if config.jax_cache_dir == "auto":
    root = (config.cache_dir or os.environ.get("SPECJAX_CACHE")
            or "~/.cache/specjax")
    return os.path.join(os.path.expanduser(root), "xla_cache")
  return os.path.expanduser(config.jax_cache_dir)


def _ratio(a: float, b: float) -> float:
  return a / b if b else float("nan")


def _speculative_run(pair: Pair, batches: Sequence[Sequence[int]],
                     batch_rows: Sequence[Sequence[int]], baseline: list,
                     gamma: int | str, cost: dict, run_kwargs: dict,
                     prompt_set: prompts_lib.PromptSet, config: Any,
                     seen: set, advance: Callable[[], None],
                     drafter_name: str, num_nodes: int = 0,
                     acceptance: str = "exact",
                     scorer: quality.Scorer | None = None,
                     base_scores: Sequence[dict[str, Any]] = ()
                     ) -> dict[str, Any]:
  """Speculative decoding of every batch at one (B, γ, drafter, acceptance
  rule), against baseline. γ may name an adaptive policy ("auto",
  "heuristic"), run with γ_max = `config.max_gamma`, carrying its estimates
  from one batch to the next; the predictions, which assume a fixed γ, are
  then NaN, as they are for token trees (`num_nodes` > 0, at most that many
  draft tokens per step). A lossy `acceptance` (`config.acceptances`)
  makes the run `lossless` False whatever its tokens; `scorer` scores its
  completions, `base_scores` (per prompt, in order) the baseline's."""
  batch_size = len(batches[0])
  fixed = isinstance(gamma, int) and not num_nodes
  width = gamma if isinstance(gamma, int) else config.max_gamma
  lossy = parse_acceptance(acceptance)[0] != "exact"
  # Int8 activations whose passes may round a row differently from a
  # decode step: verification matches decode steps up to rounding.
  rounding = bool(getattr(pair.target, "int8_rounding", False))
  greedy_check = (config.temperature == 0
                  and config.synthetic_acceptance is None)
  drafter = make_drafter(drafter_name, config, pair)
  # Cost per target forward of each drafter component: the measured c of
  # its model; lookup and jump-forward run none. A `jump+` drafter costs
  # what its fallback costs.
  model_cost = drafter_cost_ratio(
      drafter.second if isinstance(drafter, drafters.Fallback)
      and isinstance(drafter.first, drafters.JumpForward) else drafter,
      pair, cost, batches[0], run_kwargs["cache_size"], config.cost_repeats)
  component_costs = [0.0 if c in ("lookup", "jump") else model_cost
                     for c in drafter.components]
  draft_cost = max(component_costs)
  # An adaptive policy carries what it learned from one call into the next
  # (`GammaPolicy.warm`), as a server running many requests would.
  # "auto" is priced by the tuning step (measured once, cached), as a user
  # runs `python -m specjax.tune` before serving.
  policy = gamma
  if gamma == "auto":
    policy = policies.Auto.from_costs(tuning_cost.step_costs(
        pair.target, drafter, batch=batch_size, max_gamma=width,
        cache_size=run_kwargs["cache_size"]))
  elif gamma == "heuristic":
    policy = policies.Heuristic(width)
  calls, rows, texts = [], [], []
  for i, batch in enumerate(batches):
    call = timed_call(
        functools.partial(
            decode.speculative_generate, pair.target, drafter, batch,
            gamma=policy, max_gamma=width, num_nodes=num_nodes or None,
            key=jax.random.fold_in(jax.random.key(config.seed), i),
            draft_stop_threshold=config.draft_stop_threshold,
            synthetic_acceptance=config.synthetic_acceptance,
            **acceptance_kwargs(acceptance, config), **run_kwargs),
        ("spec", len(batch), _bucket(batch, run_kwargs), gamma,
         drafter_name, num_nodes, acceptance), seen,
        config.timing_repeats)
    advance()
    calls.append(call)
    if call.output.policy_state is not None:
      policy = policy.warm(call.output.policy_state)
    base = baseline[i]
    base_tokens = int(base.output.lengths.sum())
    spec_tokens = int(call.output.lengths.sum())
    for b, index in enumerate(batch_rows[i]):
      prompt = prompt_set.prompts[index]
      spec_row, base_row = call.output.row(b), base.output.row(b)
      mismatch = metrics.first_difference(base_row, spec_row)
      row = {
          "id": prompt.id, "batch_index": i,
          "prompt_tokens": len(batch[b]),
          "baseline_tokens": len(base_row), "spec_tokens": len(spec_row),
          "acceptance_rate": metrics.acceptance_rate(call.output.stats, b),
          "mean_accepted_tokens": metrics.mean_accepted_tokens(
              call.output.stats, b),
          "steps": metrics.num_steps(call.output.stats, b),
          "baseline_time_s": base.seconds, "spec_time_s": call.seconds,
          "baseline_tokens_per_s": _ratio(base_tokens, base.seconds),
          "spec_tokens_per_s": _ratio(spec_tokens, call.seconds),
          # A lossy rule is never lossless, even where (greedy) its tokens
          # match the baseline's: `matches_baseline` says whether they do.
          "lossless": (False if lossy else
                       (mismatch is None and not rounding)
                       if greedy_check else None),
          "matches_baseline": (mismatch is None) if greedy_check else None,
          "first_mismatch": mismatch if greedy_check else None,
          "finish_reason": call.output.finish_reason[b],
          "baseline_finish_reason": base.output.finish_reason[b],
      }
      row["speedup"] = _ratio(row["spec_tokens_per_s"],
                              row["baseline_tokens_per_s"])
      if config.save_text:
        row["completion_ids"] = spec_row
        row["completion"] = pair.tokenizer.decode(spec_row)[:_TEXT_CHARS]
        if greedy_check and mismatch is not None:
          row["baseline_completion"] = pair.tokenizer.decode(
              base_row)[:_TEXT_CHARS]
      texts.append(quality.completion_text(
          pair.tokenizer, spec_row, run_kwargs["eos_id"], config.stop))
      rows.append(row)

  scores = {}
  if scorer is not None and scorer.active:
    row_scores = scorer.score(texts, [r["id"] for r in rows])
    for row, score, base_score in zip(rows, row_scores, base_scores):
      row.update(score)
      row.update({f"baseline_{k}": v for k, v in base_score.items()})
    scores = quality.Scorer.summarize(row_scores)
  merged = decode.SpecStats.merge([c.output.stats for c in calls])
  summary = metrics.summarize(merged, width, draft_cost)
  base_time = sum(c.seconds for c in baseline)
  spec_time = sum(c.seconds for c in calls)
  base_tokens = sum(int(c.output.lengths.sum()) for c in baseline)
  spec_tokens = sum(int(c.output.lengths.sum()) for c in calls)
  base_tps = _ratio(base_tokens, base_time)
  spec_tps = _ratio(spec_tokens, spec_time)
  base_decode_tps = _ratio(sum(c.decode_tokens for c in baseline),
                           sum(c.decode_s for c in baseline))
  spec_decode_tps = _ratio(sum(c.decode_tokens for c in calls),
                           sum(c.decode_s for c in calls))
  lossless_rows = [r["matches_baseline"] for r in rows]
  alpha = summary["acceptance_rate"]
  verify_ratio = cost["verify_cost_ratio"].get(str(num_nodes or gamma),
                                               math.nan)
  scored = np.asarray(merged.scored)
  return {
      "gamma": gamma,
      "num_nodes": num_nodes,
      "batch_size": batch_size,
      "acceptance_rate": alpha,
      "mean_accepted_tokens": summary["mean_accepted_tokens"],
      "per_position_acceptance": summary["per_position_acceptance"],
      "drafter": drafter_name,
      # The acceptance rule (`config.acceptances` entry) and whether it is
      # lossy (not the target's distribution).
      "acceptance": acceptance,
      "lossy": lossy,
      # Int8 activations (`Model.int8_rounding`): exact up to rounding.
      "rounding": rounding,
      "draft_cost_ratio": draft_cost,
      # Drafting cost per target forward: draft forwards (every component,
      # weighted by its c) per speculative step.
      "drafting_cost_per_step": metrics.drafting_cost_per_step(
          merged, component_costs),
      "draft_forwards_by_component": dict(zip(
          drafter.components,
          np.asarray(merged.draft_forwards).reshape(-1).tolist())),
      "baseline_tokens_per_s": base_tps,
      "spec_tokens_per_s": spec_tps,
      "speedup": _ratio(spec_tps, base_tps),
      # The decoding phase alone (after the first token): what Leviathan et
      # al.'s formula predicts. The prompt passes are timed separately.
      "baseline_decode_tokens_per_s": base_decode_tps,
      "spec_decode_tokens_per_s": spec_decode_tps,
      "decode_speedup": _ratio(spec_decode_tps, base_decode_tps),
      "baseline_prefill_s": sum(c.prefill_s for c in baseline),
      "spec_prefill_s": sum(c.prefill_s for c in calls),
      "predicted_speedup": (summary["predicted_speedup"] if fixed
                            else math.nan),
      # Leviathan's formula with the measured verify/forward time ratio in
      # place of the assumed 1: tokens per step / (γc + verify ratio).
      "predicted_speedup_measured_verify": (metrics.predicted_speedup(
          alpha, width, draft_cost, verify_ratio) if fixed else math.nan),
      # For any drafter: drafted fractions and forwards per step measured
      # (specjax.metrics.predicted_speedup_extended).
      "predicted_speedup_extended": (metrics.predicted_speedup_extended(
          merged, component_costs, verify_ratio) if fixed else math.nan),
      # Draft slots the target scored per step (an adaptive policy's
      # choices; 0 is an autoregressive step).
      "mean_scored_drafts": float(np.mean(scored[scored >= 0])),
      # A mixture-of-experts target: distinct experts per layer that a
      # verification pass woke (None for a dense target).
      "experts_per_pass": metrics.experts_per_pass(
          merged, getattr(getattr(pair.target, "config", None),
                          "num_layers", 1)),
      "autoregressive_steps": float(np.mean(scored[scored >= 0] == 0)),
      "verify_cost_ratio": verify_ratio,
      "lossless": (False if lossy else (all(lossless_rows) and not rounding)
                   if greedy_check else None),
      # Prompts whose greedy output equals the baseline's.
      "lossless_prompts": sum(bool(x) for x in lossless_rows),
      "finish_reasons": _count(r["finish_reason"] for r in rows),
      # Validity rate (`json_valid_rate`, lenient and regex) and pass@1 of
      # the completions, where the config scores them (`quality`).
      **scores,
      "num_prompts": len(rows),
      "baseline_time_s": base_time,
      "spec_time_s": spec_time,
      "baseline_tokens": base_tokens,
      "spec_tokens": spec_tokens,
      "warmup_s": sum(c.warmup_s for c in calls),
      **{k: summary[k] for k in ("proposed_tokens", "accepted_tokens",
                                 "steps", "target_forwards",
                                 "draft_forwards")},
      "per_prompt": rows,
  }


def _count(values: Any) -> dict[str, int]:
  """How often each value occurs (finish reasons)."""
  out = {}
  for v in values:
    out[v] = out.get(v, 0) + 1
  return out


def _bucket(batch: Sequence[Sequence[int]], run_kwargs: dict) -> int:
  return decode.prompt_bucket(max(len(p) for p in batch),
                              run_kwargs["cache_size"])


def run_experiment(config: Any, pair: Pair | None = None) -> dict[str, Any]:
  """Runs baseline and speculative decoding over the config's sweep.

  Args:
    config: an experiment config (`configs/llama_pair.py`); validated first.
    pair: an already loaded pair to reuse (e.g. in a notebook), or None to
      load the one the config names.

  Returns:
    A JSON-ready dict: the headline run's (`config.gamma`,
    `config.batch_size`; else the sweep's first) `acceptance_rate`,
    `mean_accepted_tokens`, `per_position_acceptance`, `draft_cost_ratio`,
    `baseline_tokens_per_s`, `spec_tokens_per_s`, `speedup`,
    `predicted_speedup`, `lossless` (None unless greedy; False under a
    lossy acceptance rule), `acceptance`, `lossy`, the scores the config
    asks for (`json_valid_rate`, `pass_at_1`, ... and `baseline_` ones) and
    `per_prompt` rows (with each row's `finish_reason`); `runs` (every
    (B, γ, drafter, acceptance)), `baselines`, `cost` per B, `controls`,
    `config`, `device`, `models`, `prompts` and `timing`.

  Raises:
    ConfigError: an invalid config field.
  """
  validate_config(config)
  start = time.perf_counter()
  gammas = tuple(config.gammas) or (config.gamma,)
  batch_sizes = tuple(config.batch_sizes) or (config.batch_size,)
  if pair is None:
    pair = load_pair(config)
  prompt_set, encoded = encode_prompts(config, pair.tokenizer)
  # One S for every γ and drafter: no call compiles for a cache of its own.
  names = drafter_names(config)
  extra = max(make_drafter(n, config, pair).extra_positions
              for n in names)
  node_counts = tuple(config.get("num_nodes_sweep", ())) or (
      config.get("num_nodes", 0),)
  widest = max(gammas + node_counts + (
      (config.max_gamma,) if config.get("policies") else ()))
  cache_size = decode.default_cache_size(
      max(len(p) for p in encoded), config.max_new_tokens,
      reserve=widest + 1 + extra)
  memory_info = memory_plan(
      config, pair, cache_size, widest,
      decode.prompt_bucket(max(len(p) for p in encoded), cache_size))
  eos = None if config.ignore_eos else list(pair.tokenizer.eos_ids)
  # The generation controls apply to the baseline and every run alike.
  run_kwargs = dict(max_new_tokens=config.max_new_tokens,
                    temperature=config.temperature, top_k=config.top_k,
                    top_p=config.top_p, eos_id=eos, cache_size=cache_size,
                    **controls_lib.generation_controls(config,
                                                      pair.tokenizer))
  scorer = controls_lib.make_scorer(config, prompt_set)
  accepts = acceptance_names(config)
  if config.temperature == 0 and any(
      parse_acceptance(a)[0] != "exact" for a in accepts):
    logging.warning("Lossy acceptance under greedy decoding (temperature "
                    "0) accepts exactly what exact verification does: set "
                    "config.temperature > 0 to measure what it trades.")

  num_batches = {b: -(-len(encoded) // b) for b in batch_sizes}
  num_runs = (len(gammas) * len(node_counts)
              + len(config.get("policies", ()))) * len(accepts)
  bar = progress_lib.tqdm(total=sum(n * (1 + num_runs * len(names))
                                    for n in num_batches.values()),
                          desc="generate", unit="call",
                          disable=not config.progress)
  seen: set = set()
  runs, baselines, costs = [], {}, {}
  for batch_size in batch_sizes:
    rows = [list(range(i, min(i + batch_size, len(encoded))))
            for i in range(0, len(encoded), batch_size)]
    batches = [[encoded[j] for j in r] for r in rows]
    bar.set_postfix_str(f"B={batch_size} cost")
    # Verification at γ + 1 tokens, and at T + 1 for a tree of T nodes;
    # the draft's forward where the pair holds a draft model.
    cost = cost_lib.measure_cost(pair.target, pair.draft, batches[0],
                                 cache_size, sorted(set(gammas) | (
                                     set(node_counts) - {0})),
                                 config.cost_repeats)
    costs[str(batch_size)] = cost
    bar.set_postfix_str(f"B={batch_size} baseline")
    baseline = []
    for i, batch in enumerate(batches):
      baseline.append(timed_call(
          functools.partial(
              decode.generate, pair.target, batch,
              key=jax.random.fold_in(jax.random.key(config.seed), i),
              **run_kwargs),
          ("ar", len(batch), _bucket(batch, run_kwargs)), seen,
          config.timing_repeats))
      bar.update()
    base_time = sum(c.seconds for c in baseline)
    base_tokens = sum(int(c.output.lengths.sum()) for c in baseline)
    decode_tps = _ratio(sum(c.decode_tokens for c in baseline),
                        sum(c.decode_s for c in baseline))
    base_texts = [quality.completion_text(pair.tokenizer, c.output.row(b),
                                          eos, config.stop)
                  for c in baseline for b in range(len(c.output.lengths))]
    base_scores = (scorer.score(base_texts, [prompt_set.prompts[j].id
                                             for r in rows for j in r])
                   if scorer.active else [{} for _ in base_texts])
    baselines[str(batch_size)] = {
        "finish_reasons": _count(r for c in baseline
                                 for r in c.output.finish_reason),
        **quality.Scorer.summarize(base_scores),
        "batch_size": batch_size, "time_s": base_time, "tokens": base_tokens,
        "tokens_per_s": _ratio(base_tokens, base_time),
        "decode_tokens_per_s": decode_tps,
        # Decode steps/s times the roofline time of a step: 1 = at roofline.
        "roofline_efficiency": (decode_tps / batch_size
                                * cost.get("target_roofline_ms", math.nan)
                                / 1e3),
        "warmup_s": sum(c.warmup_s for c in baseline)}
    for name in names:
      for accept in accepts:
        for nodes in node_counts:
          if nodes and (not is_tree_drafter(name)
                        or parse_acceptance(accept)[0] != "exact"):
            continue  # chains only: the nodes=0 row stands
          policies = () if nodes else tuple(config.get("policies", ()))
          for gamma in gammas + policies:
            bar.set_postfix_str(
                f"B={batch_size} γ={gamma} {name}"
                + (f" T={nodes}" if nodes else "")
                + (f" {accept}" if accept != "exact" else ""))
            runs.append(_speculative_run(
                pair, batches, rows, baseline, gamma, cost, run_kwargs,
                prompt_set, config, seen, bar.update, name, nodes, accept,
                scorer, base_scores))
  bar.close()

  head_gamma = config.gamma if config.gamma in gammas else gammas[0]
  head_batch = (config.batch_size if config.batch_size in batch_sizes
                else batch_sizes[0])
  head_drafter = config.drafter if config.drafter in names else names[0]
  head_nodes = (config.get("num_nodes", 0)
                if config.get("num_nodes", 0) in node_counts
                else node_counts[0])
  head_accept = (config.acceptance if config.acceptance in accepts
                 else accepts[0])
  if parse_acceptance(head_accept)[0] != "exact":
    head_nodes = 0  # lossy rules ran chains only
  head = next(r for r in runs
              if r["gamma"] == head_gamma and r["batch_size"] == head_batch
              and r["drafter"] == head_drafter
              and r["num_nodes"] == head_nodes
              and r["acceptance"] == head_accept)
  if (head_gamma, head_batch, head_drafter, head_nodes, head_accept) == (
      config.gamma, config.batch_size, config.drafter,
      config.get("num_nodes", 0), config.acceptance):
    # What the next run of this job will be priced by (`pair.workload`).
    learned.record(config, head["steps"] / num_batches[head_batch])
  keys = ("acceptance_rate", "mean_accepted_tokens", "per_position_acceptance",
          "draft_cost_ratio", "baseline_tokens_per_s", "spec_tokens_per_s",
          "speedup", "decode_speedup", "predicted_speedup", "lossless",
          "acceptance", "lossy", "rounding")
  head_base = baselines[str(head_batch)]
  scored = {k: head[k] for k in ("json_valid_rate", "json_valid_lenient_rate",
                                 "regex_match_rate", "pass_at_1")
            if k in head}
  scored.update({f"baseline_{k}": head_base[k] for k in scored})
  return {
      **{k: head[k] for k in keys},
      **scored,
      "gamma": head_gamma,
      "num_nodes": head_nodes,
      "batch_size": head_batch,
      "drafter": head_drafter,
      "synthetic": config.synthetic_acceptance is not None,
      "controls": controls_lib.controls_info(config),
      "per_prompt": head["per_prompt"],
      "sweep": {"gammas": list(gammas), "batch_sizes": list(batch_sizes),
                "drafters": list(names),
                "acceptances": list(accepts),
                "policies": list(config.get("policies", ())),
                "num_nodes": list(node_counts)},
      "runs": runs,
      "baselines": baselines,
      "cost": costs,
      "memory": memory_info,
      "config": config.to_dict(),
      "device": hardware.machine(),
      # "draft" is None where no drafter that ran drafts with a model.
      "models": {"target": model_info(config.target, pair.target),
                 "draft": (None if pair.draft is None
                           else model_info(config.draft, pair.draft))},
      "matmul": {"target": matmul_info(config, pair.target),
                 "draft": matmul_info(config, pair.draft)},
      "quantize": pair.quantize,
      "prompts": {
          "set": prompt_set.name, "source": prompt_set.source,
          "count": len(encoded), "chat_template": config.chat_template,
          "tokens": [len(p) for p in encoded], "cache_size": cache_size},
      "timing": {"load_s": pair.load_s,
                 "total_s": time.perf_counter() - start},
  }


def run_and_save(config: Any, pair: Pair | None = None) -> dict[str, Any]:
  """`run_experiment`, then plots and results.json into `config.output_dir`.

  Returns:
    The results, with `plots` (file names written) and `results_path`.
  """
  results = run_experiment(config, pair)
  if not distributed.is_main():
    return results  # one process writes (they all computed the same)
  # The figures first: a plotting error must not lose a long run.
  results["results_path"] = str(report.write_results(results,
                                                     config.output_dir))
  if config.plots:
    results["plots"] = report.save_plots(results, config.output_dir)
    report.write_results(results, config.output_dir)
  return results
