"""The batch crossover: decoding tokens/s against B for every γ policy.

For each batch size B, runs autoregressive decoding, speculative decoding at
each fixed γ, transformers' heuristic schedule and `gamma="auto"`
(`specjax.policies`) on the same prompts (`auto` cold, from its prior, and
`auto warm`, started from the estimates the cold run ended with, then each
round from the round before it, as a server carries them from request to
request), and reports the decoding-phase tokens/s of each (timed within
the call, from the host's receipt of its first streamed token:
`hardware.timed_call(streamed=True)`; at large B the prompt pass is most
of a call, and a difference of two calls' times would be mostly their
noise), the ratio
of `auto` to the best of the others, and the cost model's prediction beside
each measurement.
Each program first runs once untimed (compilation; the cold `auto` run
is the generation `auto warm` starts from). Then `repeats` rounds run
every policy in an order shuffled by round, so a drift in the machine's
speed, or a program's running faster after itself, reaches all policies
alike (each call timed `timings` times over the same work, in as many
passes over the policies, their mean kept, or the fastest: `keep`); each
figure is the rounds' tokens over their time (`_policy_row`; the paired
ratio is the median over rounds of `auto` over the best policy in the
same round, which cancels a drift between rounds). Round r runs every
policy with key r: with synthetic α the policies of one round decode the
same synthetic text (`acceptance.Synthetic`: the verdict on a draft is a
property of its position, as in a real text), so a round's ratios
compare their choices, not their luck, and the rounds decode
different texts. Beside the measured ratios, those `specjax.policies.simulate`
expects from the same policies and costs over many draws (the policy's
own loss, without the machine's noise or the cost model's error). The
forward costs are read as `gamma="auto"` reads them, before each round:
from the cost cache, timed at the first read and again when due
(`cost.measure`); `refresh_costs` first discards the cached passes.

Config: `configs/crossover.py` (its docstring has the commands); run by
`python -m experiments.run --config=configs/crossover.py:...`.

With random weights, acceptance is synthetic (`synthetic_acceptance`: each
draft accepted with probability α by its position's draw in the
generation's synthetic text, not distribution-preserving); figures from
such runs must be labelled synthetic. Rows ignore EOS, so every row does
the same work.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable

import jax
import numpy as np

from experiments import prompts as prompts_lib
from experiments.validation import ConfigError
from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import policies as policies_lib
from specjax import registry
from specjax import testing
from specjax.policies import simulate
from specjax.tuning import cost

__all__ = ["merge", "run", "table"]

# The policies that choose γ as they go; the others (`ar`, each fixed γ)
# are what `auto` is measured against.
_ADAPTIVE = ("auto", "auto warm", "heuristic")


def _load(config: Any, name: str, seed: int):
  if name == "tiny":  # smoke runs: the random tiny pair
    return testing.tiny_pair(0)[seed], None
  if config.weights == "real":
    return registry.load_pretrained(name, progress=False,
                                    cache_dir=config.cache_dir or None,
                                    quantize=config.quantize or None)
  return testing.random_model(name, seed), None


def _prompts(config: Any, tokenizer, batch: int,
             vocab: int) -> list[list[int]]:
  if tokenizer is None:
    return testing.random_prompts(batch, vocab, config.prompt_tokens)
  # Rows beyond the set's size take its prompts again, in order.
  prompt_set = prompts_lib.load_prompts(config.prompts)
  return [prompts_lib.encode_prompt(
      tokenizer, prompt_set.prompts[i % len(prompt_set.prompts)],
      chat_template=True) for i in range(batch)]


def _conditional_acceptance(stats, gamma: int) -> list[float]:
  """a_j = P(position j accepted | all before were), from the counters."""
  accepted = np.asarray(stats.accepted_by_position, float)[:gamma]
  reached = np.concatenate([[float(np.asarray(
      stats.proposed_by_position)[0])], accepted[:-1]])
  return list(np.where(reached > 0, accepted / np.maximum(reached, 1), 0.0))


def _steps_ms(stats, target_costs, draft_costs) -> float:
  """Predicted ms of the speculative steps a generation took: each step's
  target pass at its width, and its draft passes, the first of a drafting
  step at the two-token cost."""
  scored = np.asarray(stats.scored)
  per_step = scored.max(axis=0)  # [M] the batch's width - 1, -1 unused
  target_ms = sum(target_costs.at(int(k) + 1) for k in per_step if k >= 0)
  if not draft_costs:
    return target_ms
  forwards = int(np.sum(stats.draft_forwards))
  first_passes = int(np.sum(per_step > 0))
  return target_ms + forwards * draft_costs.at(1) + first_passes * (
      draft_costs.drafting_ms(1) - draft_costs.at(1))


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What every policy and α at one B share: the cache size S, the target
  widths timed, and how to read the forward costs measured at S (a
  forward's cost grows with S)."""

  cache_size: int
  widths: list[int]
  measure: Callable[..., policies_lib.ForwardCosts]
  target: Any
  draft: Any
  config: Any

  def costs(self) -> tuple[policies_lib.ForwardCosts,
                           policies_lib.ForwardCosts | None]:
    """The target's and the draft model's (None for prompt lookup) costs,
    as `gamma="auto"` would read them now: from the cache, timed again
    when due (`cost.measure`), so a table taken at a bad moment is
    outvoted while the sweep goes on."""
    return (self.measure(self.target, chunks=self.widths),
            self.measure(self.draft, chunks=(1, 2))
            if self.config.drafter == "model" else None)

  def auto_costs(self) -> dict[str, Any]:
    """`policies_lib.Auto.create`'s cost arguments from `costs`."""
    target_costs, draft_costs = self.costs()
    return {"target_ms": [target_costs.at(w) for w in
                          policies_lib.verify_widths(
                              self.config.max_gamma)],
            **(policies_lib.Auto.draft_costs(draft_costs)
               if draft_costs else {})}


def _setup(config: Any, target, draft, prompts) -> _Setup:
  """One B's `_Setup`; with ``refresh_costs``, its cost tables measured
  anew (else `cost.measure` times them at their first read, and discards
  them itself where the machine has changed)."""
  batch, gammas = len(prompts), config.gammas
  widths = sorted({1, *(g + 1 for g in gammas),
                   *policies_lib.verify_widths(config.max_gamma)})
  cache_size = decode.default_cache_size(
      max(map(len, prompts)), config.max_new_tokens, reserve=widths[-1])
  measure = functools.partial(cost.measure, batch=batch,
                              cache_size=cache_size)
  setup = _Setup(cache_size, widths, measure, target, draft, config)
  if config.refresh_costs:
    dataclasses.replace(
        setup, measure=functools.partial(measure, refresh=True)).costs()
  return setup


def _run_batch(config: Any, target, drafter, prompts, alpha, seen,
               setup: _Setup) -> dict:
  """Every policy at one B and α: warm-up, `repeats` timed rounds, and
  the table's cell (`crossover.json`'s `results` entry)."""
  batch, gammas = len(prompts), config.gammas
  cache_size, widths = setup.cache_size, setup.widths
  policies = {"ar": None, **{f"γ={g}": g for g in gammas},
              "heuristic": policies_lib.Heuristic(config.max_gamma),
              "auto": policies_lib.Auto.create(max_gamma=config.max_gamma,
                                           **setup.auto_costs())}
  kwargs = dict(max_new_tokens=config.max_new_tokens, cache_size=cache_size)
  make = lambda gamma: (
      functools.partial(decode.generate, target, prompts, **kwargs)
      if gamma is None else functools.partial(
          decode.speculative_generate, target, drafter, prompts,
          gamma=gamma, synthetic_acceptance=alpha, **kwargs))
  calls = {name: (gamma, make(gamma)) for name, gamma in policies.items()}
  # Every program compiles and runs once untimed (`hardware.warm_up`), with a
  # key no timed round uses. As a server would, the estimates the cold
  # `auto` warm-up observed start the next request (`Auto.warm`): `auto
  # warm`, the same program, nothing compiles; each of its rounds then
  # starts from what the one before it ended with.
  for name, (_, fn) in list(calls.items()):
    warmed, _ = hardware.warm_up(functools.partial(fn, key=config.repeats),
                                 (name, batch), seen, streamed=True)
    if name == "auto":
      warm = policies["auto"].warm(warmed.policy_state)
      calls["auto warm"] = warm, make(warm)
  # Rounds interleave the policies, so a drift of the machine's speed
  # during the run reaches them all alike, in an order shuffled by pass:
  # a program runs faster right after itself (the same code and buffers
  # hot), which a fixed order would credit to one policy (`auto warm`
  # after `auto`). Round r runs every policy with the key r: with
  # synthetic α one synthetic text for all policies within a round,
  # another text from round to round.
  runs = {}
  for round_key in range(config.repeats):
    # Both `auto`s price their steps by the cost table as it is now, as
    # `gamma="auto"` reads it at each call: timed again when due, so the
    # table comes to stand for the machine over the run, not the moment
    # it was first timed (`cost.measure`).
    costs = setup.auto_costs()
    for name in ("auto", "auto warm"):
      policy = calls[name][0].priced(**costs)
      calls[name] = policy, make(policy)
    timed = {}
    # A round times every policy ``timings`` times, one pass over them
    # all per timing, each pass in its own order, and keeps each one's
    # mean (or fastest, ``keep``): a policy's timings lie a whole pass
    # apart, so they sample the machine at different moments (timed back
    # to back, both would fall in one of its states or slow moments).
    for timing in range(config.timings):
      for name in np.random.default_rng((round_key, timing)).permutation(
          list(calls)).tolist():
        # α and the key are traced (nothing compiles anew).
        timed.setdefault(name, []).append(hardware.timed_call(
            functools.partial(calls[name][1], key=round_key),
            (name.split()[0], batch), seen, 1, streamed=True))
    keep = min if config.keep == "fastest" else np.mean
    kept = {name: dataclasses.replace(
        times[0], seconds=float(keep([c.seconds for c in times])),
        prefill_s=float(keep([c.prefill_s for c in times])))
            for name, times in timed.items()}
    for name, call in kept.items():
      if not call.decode_s:
        raise ConfigError(f"{name}: decoding took no longer than the "
                             "prompt pass alone; raise max_new_tokens.")
      runs.setdefault(name, []).append(call)
    # As a server: the next request starts from all this one learned too,
    # so each round is another warm start (round r after r + 1
    # generations), not the warm-up's one start R times over.
    warm = calls["auto warm"][0].warm(kept["auto warm"].output.policy_state)
    calls["auto warm"] = warm, make(warm)
  # The predictions and the simulation price by the table the rounds
  # ended with.
  target_costs, draft_costs = setup.costs()
  policies["auto"] = calls["auto"][0]
  rows = {name: _policy_row(gamma, runs[name], batch, target_costs,
                            draft_costs)
          for name, (gamma, _) in calls.items()}
  return {"batch": batch, "alpha": alpha, "tokens": config.max_new_tokens,
          "repeats": config.repeats, "keep": config.keep,
          "prompt_tokens": (
              config.prompt_tokens if config.weights == "random" else None),
          "policies": rows, **_over_best(rows),
          **_simulated(policies, rows, batch, alpha, config.max_new_tokens),
          "cache_size": cache_size,
          "target_ms": {str(w): target_costs.at(w) for w in widths},
          "draft_ms": ({str(t): draft_costs.at(t) for t in (1, 2)}
                       if draft_costs else {})}


def _over_best(rows: dict) -> dict:
  """`auto` and `auto warm` over the best of autoregressive decoding and
  every fixed γ (`rows`: `_policy_row`s by name), pooled and paired."""
  best = max((k for k in rows if k not in _ADAPTIVE),
             key=lambda k: rows[k]["tokens_per_s"])
  ratio = lambda name: rows[name]["tokens_per_s"] / rows[best][
      "tokens_per_s"]
  return {"auto_over_best": ratio("auto"),
          "auto_warm_over_best": ratio("auto warm"), "best": best,
          "auto_over_best_paired": _paired(rows, "auto", best),
          "auto_warm_over_best_paired": _paired(rows, "auto warm", best)}


def _round_tokens(result: dict, name: str) -> list[float]:
  """The decoding tokens of each of a policy's rounds. Runs written before
  they were kept had random weights, which run every row to its length."""
  row = result["policies"][name]
  return row.get("decode_tokens_rounds", [
      (result["tokens"] - 1) * result["batch"]] * len(
          row["tokens_per_s_rounds"]))


def _pooled_rate(tokens, rates) -> np.ndarray:
  """Rounds' decoding tokens over their decoding time, over the last axis
  (`tokens`, `rates`: [..., n] per round): their throughput together, as
  `_policy_row` pools one run's calls."""
  tokens = np.asarray(tokens, float)
  return tokens.sum(-1) / (tokens / np.asarray(rates, float)).sum(-1)


def _paired(rows: dict, name: str, best: str) -> float:
  """The median over rounds of `name`'s tokens/s over `best`'s in the same
  round: a round runs them back to back, so the machine's drift between
  rounds cancels."""
  return float(np.median(np.divide(rows[name]["tokens_per_s_rounds"],
                                    rows[best]["tokens_per_s_rounds"])))


def _interval(result: dict, name: str, level: float = 0.9,
              samples: int = 4000) -> tuple[float, float]:
  """A bootstrap interval of `name`'s tokens/s over the best of
  autoregressive decoding and every fixed γ: the rounds resampled with
  replacement, the same rounds for every policy (a round runs them all on
  one synthetic text), each policy's rate pooled over them as
  `_policy_row` pools it, the best chosen again in each resample. How far
  the run's own rounds leave the measured ratio uncertain; a cell whose
  whole interval lies under 0.95 is a loss beyond the run's scatter."""
  policies = result["policies"]
  rates = {k: np.asarray(v["tokens_per_s_rounds"])
           for k, v in policies.items()}
  tokens = {k: np.asarray(_round_tokens(result, k), float)
            for k in policies}
  n = len(rates[name])
  rounds = np.random.default_rng(0).integers(0, n, (samples, n))  # [S, n]
  pooled = lambda k: _pooled_rate(tokens[k][rounds],  # [S]
                                  rates[k][rounds])
  best = np.max([pooled(k) for k in policies
                 if k not in _ADAPTIVE], 0)
  low, high = np.quantile(pooled(name) / best,
                          [(1 - level) / 2, (1 + level) / 2])
  return float(low), float(high)


def _predicted(gamma, call, target_costs, draft_costs) -> float:
  """The cost model's tokens/s for one run of a policy."""
  emitted = np.maximum(call.output.lengths - 1, 0)  # [B] decoding phase
  if gamma is None or isinstance(gamma, int):
    # The batch runs until its longest row ends: price that many tokens
    # per row (`expected_steps`), then count the tokens rows did emit.
    acceptance = (_conditional_acceptance(call.output.stats, gamma)
                  if gamma else [])
    longest = max(int(emitted.max()), 1)
    rate = policies_lib.StepCosts.for_fixed(
        gamma or 0, target_costs, draft_costs).tokens_per_s(
            acceptance, gamma or 0, batch=target_costs.batch, tokens=longest)
    return rate * emitted.mean() / longest
  return int(emitted.sum()) / (_steps_ms(call.output.stats, target_costs,
                                         draft_costs) / 1e3)


def _policy_row(gamma, runs, batch, target_costs, draft_costs) -> dict:
  """One policy's figures over its rounds (`runs`: `hardware.Call`s).

  Its tokens/s is the rounds' decoding tokens over their decoding time:
  the throughput of the workload they make up. Not the median of the
  rounds' rates: with synthetic acceptance at a small B, a round's rate
  varies more with its sample path than with the machine, skewed
  differently for each policy (an adaptive one's unlucky paths are the
  worse), and their medians compare them with a bias (at machine G's
  B = 1 costs and α = 0.95, simulated: `auto` expects 1.01x the best
  fixed γ, and the median over 16 rounds puts it under 0.95x in 14% of
  runs, the pooled rate in none). The median stays beside it."""
  rates = [call.decode_tokens / call.decode_s for call in runs]
  measured = (sum(call.decode_tokens for call in runs)
              / sum(call.decode_s for call in runs))
  predicted = float(np.median([
      _predicted(gamma, call, target_costs, draft_costs) for call in runs]))
  row = {"tokens_per_s": measured, "tokens_per_s_median": float(
      np.median(rates)), "tokens_per_s_rounds": rates,
         "decode_tokens_rounds": [int(call.decode_tokens) for call in runs],
         "predicted_tokens_per_s": predicted,
         "predicted_over_measured": predicted / measured}
  if gamma is not None:
    steps = [np.asarray(call.output.stats.scored) for call in runs]
    steps = np.concatenate([s[s >= 0] for s in steps])
    row.update(
        tau=float(np.mean([(call.output.lengths.sum() - batch)
                           / max(int(call.output.stats.steps), 1) / batch
                           for call in runs])),
        autoregressive_steps=float(np.mean(steps == 0)),
        mean_drafts=float(np.mean(steps)))
  if isinstance(gamma, int):
    row["acceptance"] = np.mean(
        [_conditional_acceptance(call.output.stats, gamma)
         for call in runs], 0).tolist()
  return row


def _simulated(policies, rows, batch, alpha, tokens: int) -> dict:
  """`auto`, cold and warm from one generation (`warm_after=1`, as `auto warm`'s
  first round runs; later rounds start after more: at machine G's B = 4 costs
  and α = 0.8 the simulator expects 0.990 after one, 0.992 after two, 0.995
  after four), over the best of autoregressive and the fixed γ <= γ_max as
  `specjax.policies.simulate` expects it: the same policies and costs, the mean
  over many acceptance draws, no timing noise. With real weights the
  acceptance is the per-position rate the widest fixed γ measured, its last
  value repeated past its γ."""
  auto = policies["auto"]
  fixed = [g or 0 for g in policies.values()
           if g is None or isinstance(g, int) and g <= auto.max_gamma]
  if alpha is None:
    measured = rows[f"γ={max(fixed)}"]["acceptance"]
    alpha = (measured + measured[-1:] * auto.max_gamma)[:auto.max_gamma]
  ratio = functools.partial(
      simulate.over_best, auto, auto.costs(), alpha=alpha,
      batch=batch, tokens=tokens, gammas=fixed)
  return {"auto_over_best_simulated": ratio(),
          "auto_warm_over_best_simulated": ratio(warm_after=1)}


def table(results: list[dict]) -> str:
  """The cells as a markdown table, then predicted over measured."""
  names = list(results[0]["policies"])
  head = ["α", "B", "N"] + names + [
      "auto/best", "auto warm/best", "90% interval", "paired",
      "auto/best simulated", "auto warm/best simulated"]
  lines = [" | ".join(head), " | ".join("---" for _ in head)]
  for r in results:
    alpha = "real" if r["alpha"] is None else f"{r['alpha']:.2f}"
    cells = [f"{r['policies'][n]['tokens_per_s']:.2f}" for n in names]
    lines.append(" | ".join([alpha, str(r["batch"]), str(r["tokens"])]
                            + cells + [f"{r['auto_over_best']:.2f}x",
                               f"{r['auto_warm_over_best']:.2f}x",
                               " / ".join("%.2f-%.2f" % _interval(r, n)
                                          for n in ("auto", "auto warm")),
                               _optional_cell(r, "auto_over_best_paired"),
                               _optional_cell(r, "auto_over_best_simulated"),
                               _optional_cell(
                                   r, "auto_warm_over_best_simulated")]))
  lines += ["", "predicted / measured tokens/s:"]
  lines += [" | ".join(["α", "B"] + names)]
  for r in results:
    alpha = "real" if r["alpha"] is None else f"{r['alpha']:.2f}"
    cells = [f"{r['policies'][n]['predicted_over_measured']:.2f}"
             for n in names]
    lines.append(" | ".join([alpha, str(r["batch"])] + cells))
  return "\n".join(lines)


def _optional_cell(result: dict, field: str) -> str:
  """A ratio that runs written before its column existed do not have."""
  ratio = result.get(field)
  return "-" if ratio is None else f"{ratio:.2f}x"


def _plot(results, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  alphas = sorted({r["alpha"] for r in results}, key=lambda a: a or 0)
  fig, axes = plt.subplots(1, len(alphas), figsize=(5 * len(alphas), 4),
                           squeeze=False)
  for ax, alpha in zip(axes[0], alphas):
    part = [r for r in results if r["alpha"] == alpha]
    for name in part[0]["policies"]:
      ax.plot([r["batch"] for r in part],
              [r["policies"][name]["tokens_per_s"] for r in part],
              marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("decoding tokens/s (all rows)")
    ax.set_title("real acceptance" if alpha is None
                 else f"synthetic α = {alpha}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _write(config: Any, results: list[dict], **fields) -> None:
  """crossover.json in `config.output_dir`: the machine, the settings
  (`fields` override the config's, as a merge keeps its runs') and the
  cells."""
  os.makedirs(config.output_dir, exist_ok=True)
  out = {"machine": hardware.machine(), "jax": jax.__version__,
         "source": hardware.source_version(),
         "weights": config.weights, "drafter": config.drafter,
         "gammas": list(config.gammas),
         "max_gamma": config.max_gamma, **fields, "results": results}
  with open(os.path.join(config.output_dir, "crossover.json"), "w") as f:
    json.dump(out, f, indent=1)


def _pooled(like: list[dict]) -> dict:
  """One cell from several runs' cells at one α and B (``pool``): each
  policy's rounds joined, its tokens/s their decoding tokens over their
  decoding time as `_policy_row` pools one run's, the ratios to the best
  taken again (a round of any run still runs every policy back to back,
  so `_paired` and `_interval` hold). Predicted over measured is the
  rounds-weighted mean of the runs'; the simulated ratios, each from its
  own run's cost table, are left out."""
  if len(like) == 1:
    return like[0]
  if len({r["tokens"] for r in like}) > 1:
    raise ConfigError(
        f"`pool`: the runs at α = {like[0]['alpha']}, B = "
        f"{like[0]['batch']} decoded {[r['tokens'] for r in like]} tokens "
        "per row; only cells of one length can be pooled.")
  rows = {}
  for name in like[0]["policies"]:
    rates = [x for r in like for x in r["policies"][name][
        "tokens_per_s_rounds"]]
    tokens = [x for r in like for x in _round_tokens(r, name)]
    rows[name] = {
        "tokens_per_s": float(_pooled_rate(tokens, rates)),
        "tokens_per_s_median": float(np.median(rates)),
        "tokens_per_s_rounds": rates, "decode_tokens_rounds": tokens,
        "predicted_over_measured": float(np.average(
            [r["policies"][name]["predicted_over_measured"] for r in like],
            weights=[len(r["policies"][name]["tokens_per_s_rounds"])
                     for r in like]))}
  first = like[0]
  return {"batch": first["batch"], "alpha": first["alpha"],
          "tokens": first["tokens"],
          "repeats": sum(r["repeats"] for r in like),
          "prompt_tokens": first.get("prompt_tokens"), "policies": rows,
          **_over_best(rows), "pooled": len(like),
          "source": "+".join(str(r["source"]) for r in like)}


def merge(config: Any) -> list[dict]:
  """Joins the crossover.json of the runs in `config.merge` (one B per
  process, on one machine with the same policies; each result keeps its
  own tokens per row and repeats, shorter at large B) into one in
  `config.output_dir`, sorted by α then B, with its table and plot. Where
  several runs hold the same α and B (a cell rerun with more rounds), the
  one listed last is kept, or with `config.pool` all of them are joined
  (`_pooled`). Each cell keeps the commit it ran on (`source`); the
  merged file lists them all.

  Raises:
    ConfigError: the runs differ in machine, weights, drafter or γ.
  """
  dirs = [d for d in config.merge.split(",") if d]
  runs = []
  for path in dirs:
    with open(os.path.join(path, "crossover.json")) as f:
      runs.append(json.load(f))
  settings = ("machine", "weights", "drafter", "gammas", "max_gamma")
  # One machine: the same CPU and cores (its record also names the
  # commit, which may differ from run to run).
  like = lambda run_, k: (
      (run_[k].get("cpu_id"), run_[k].get("cpu_count")) if k == "machine"
      else run_.get(k))
  for run_, path in zip(runs[1:], dirs[1:]):
    differ = [k for k in settings if like(run_, k) != like(runs[0], k)]
    if differ:
      raise ConfigError(f"{path} was run with other {differ} than "
                        f"{dirs[0]}; only like runs can be merged.")
  cells = {}
  for run_ in runs:
    for r in run_["results"]:
      cells.setdefault((r["alpha"], r["batch"]), []).append(
          {"source": run_.get("source"), **r})
  join = _pooled if config.pool else lambda like: like[-1]
  results = sorted(map(join, cells.values()),
                   key=lambda r: (r["alpha"] or 0, r["batch"]))
  _write(config, results, **{k: runs[0][k] for k in settings}, merged=dirs,
         source=sorted({str(r["source"]) for r in results}))
  return results


def run(config: Any) -> list[dict]:
  """The sweep `config` describes (`configs/crossover.py`), or the merge
  of earlier runs (`config.merge`): writes crossover.json and
  crossover.png into `config.output_dir`, prints each cell's table as it
  is done, and returns the cells.

  Raises:
    ConfigError: α given with real weights, or runs that cannot merge.
  """
  if config.merge:
    results = merge(config)
  else:
    alphas = list(config.alphas) or [None]
    if config.weights == "real" and alphas != [None]:
      raise ConfigError("config.alphas (synthetic acceptance) needs "
                        "config.weights='random'.")
    target, tokenizer = _load(config, config.target, 0)
    draft, _ = _load(config, config.draft, 1)
    drafter = (drafters.DraftModel(draft) if config.drafter == "model"
               else drafters.PromptLookup().for_target(target, tokenizer))
    results, seen = [], set()
    for batch in config.batch_sizes:
      prompts = _prompts(config, tokenizer, batch, target.vocab_size)
      setup = _setup(config, target, draft, prompts)
      for alpha in alphas:
        results.append(_run_batch(config, target, drafter, prompts, alpha,
                                  seen, setup))
        print(table(results[-1:]), flush=True)
        _write(config, results)  # after each (B, α): a long sweep keeps it
  _plot(results, os.path.join(config.output_dir, "crossover.png"))
  return results
