"""Tables, results.json and plots for `experiments.bench.run_experiment`.

Everything here reads the result dict only, so a notebook can re-plot or
re-print a saved `results.json`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import textwrap
from typing import Any, Sequence

import numpy as np

__all__ = ["drafter_label", "format_report", "save_plots", "to_json",
           "write_results"]

RESULTS_FILE = "results.json"


def _jsonable(x: Any) -> Any:
  """Numpy scalars/arrays to Python, NaN and inf to None (strict JSON)."""
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return _jsonable(x.tolist())
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def to_json(results: dict[str, Any]) -> str:
  return json.dumps(_jsonable(results), indent=1, ensure_ascii=False)


def write_results(results: dict[str, Any],
                  output_dir: str | os.PathLike) -> pathlib.Path:
  """Writes `<output_dir>/results.json` (atomically) and returns its path."""
  out = pathlib.Path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  path = out / RESULTS_FILE
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(to_json(results))
  os.replace(tmp, path)
  return path


# ------------------------------------------------------------------ tables


def drafter_label(name: str, config: dict[str, Any]) -> str:
  """What the drafter `name` (a `configs/llama_pair.py` drafter) drafts
  with, in words, for titles: a model drafter names `config["draft"]`,
  the others what they are (prompt lookup has no model)."""
  if name.startswith("jump+"):
    return f"jump-forward, else {drafter_label(name[5:], config)}"
  kind, _, layer = name.partition("@")
  draft = config.get("draft", "draft")
  if draft == "same":
    quantized = config.get("draft_quantize")
    draft = f"the target in {quantized}" if quantized else "the target"
    if config.get("draft_experts"):
      draft += f" with {config['draft_experts']} expert(s) per token"
  return {
      "model": draft,
      "lookup": "prompt lookup",
      "fallback": f"prompt lookup, else {draft}",
      "cascade": f"{draft} over prompt lookup",
      "early_exit": (f"the target's first {layer} layers" if layer
                     else "early exit"),
      "layer_skip": "layer skip",
      "medusa": "Medusa heads",
      "eagle": "EAGLE layer",
  }.get(kind, name)


def _drafted_by(results: dict[str, Any]) -> str:
  """Every drafter that ran, in words (`drafter_label`), `/`-separated."""
  names = (results.get("sweep", {}).get("drafters")
           or [results.get("drafter", "model")])
  return " / ".join(drafter_label(n, results["config"]) for n in names)


def _f(x: Any, spec: str = ".2f", suffix: str = "") -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "-"
  return f"{x:{spec}}{suffix}"


def _lossless(run: dict[str, Any]) -> str:
  """k/n prompts equal to the baseline (greedy), n/a, or `lossy` for a
  lossy acceptance rule (whatever its tokens)."""
  if run.get("lossy"):
    return "lossy"
  if run.get("lossless") is None:
    return "n/a"
  equal = f"{run['lossless_prompts']}/{run['num_prompts']}"
  return f"rounding {equal}" if run.get("rounding") else equal


def _acceptance(run: dict[str, Any]) -> str:
  """The run's acceptance rule, marked when lossy."""
  name = run.get("acceptance", "exact")
  return f"{name} (lossy)" if run.get("lossy") else name


def _controls_line(results: dict[str, Any]) -> list[str]:
  """The generation controls of the run, one line (none: nothing)."""
  info = dict(results.get("controls") or {})
  if not info:
    return []
  info.pop("scoring_schema", None)
  schema = info.pop("json_schema", None)
  parts = [f"{k}={v!r}" for k, v in info.items()]
  if schema:
    short = schema if len(schema) <= 60 else schema[:57] + "..."
    parts.append(f"json_schema={short}")
  return [f"generation controls (baseline and every run): "
          f"{', '.join(parts) or 'none (scored only)'}"]


def _quality_lines(results: dict[str, Any]) -> list[str]:
  """Validity rate and pass@1 of the baseline and every run, beside α and
  speedup, where the config scored them."""
  runs = results["runs"]
  lines = []
  for key, title, cols in (
      ("json_valid_rate", "structured output (validity: parses with "
       "json.loads and validates against the schema; lenient: the object "
       "inside a code fence or prose)",
       (("json_valid_rate", "valid"), ("json_valid_lenient_rate",
                                        "lenient"),
        ("regex_match_rate", "regex"))),
      ("regex_match_rate", "regex output (the whole completion matches)",
       (("regex_match_rate", "regex"),)),
      ("pass_at_1", "HumanEval pass@1 by acceptance rule (lossy rules are "
       "not the target's distribution)", (("pass_at_1", "pass@1"),))):
    if not any(key in r for r in runs):
      continue
    if key == "regex_match_rate" and any("json_valid_rate" in r
                                         for r in runs):
      continue  # a column of the structured table
    cols = [c for c in cols if any(c[0] in r for r in runs)]
    rows = []
    for b, base in results["baselines"].items():
      rows.append(["autoregressive", b, "-", "exact", "-", "1.00x"]
                  + [_f(base.get(k), ".3f") for k, _ in cols]
                  + [_finish(base.get("finish_reasons")), "reference"])
    for r in runs:
      rows.append([r.get("drafter", "model"), str(r["batch_size"]),
                   str(r["gamma"]), _acceptance(r),
                   _f(r["acceptance_rate"], ".3f"),
                   _f(r["speedup"], ".2f", "x")]
                  + [_f(r.get(k), ".3f") for k, _ in cols]
                  + [_finish(r.get("finish_reasons")), _lossless(r)])
    lines += ["", f"{title}:",
              table(["run", "B", "γ", "acceptance", "α", "speedup"]
                    + [c for _, c in cols] + ["finish", "lossless"], rows)]
  return lines


def _finish(counts: dict[str, int] | None) -> str:
  """{"eos": 3, "length": 1} -> "eos 3, length 1"."""
  return ", ".join(f"{k} {v}" for k, v in sorted((counts or {}).items())
                   ) or "-"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """A plain right-aligned text table."""
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  line = lambda cells: "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
  return "\n".join([line(header), line(["-" * w for w in widths])]
                   + [line(r) for r in rows])


def _roofline_lines(results: dict[str, Any]) -> list[str]:
  """Forward and verify passes of both models against their rooflines."""
  lines = []
  for b, c in results["cost"].items():
    if "read_bandwidth_gb_s" not in c:
      continue
    base = results["baselines"][b]
    lines += ["", f"roofline (B={b}; weight bytes / "
              f"{c['read_bandwidth_gb_s']:.1f} GB/s large-array read):"]
    rows = []
    for m in ("target", "draft"):
      if f"{m}_roofline_ms" not in c:
        continue
      verify = ", ".join(
          f"γ={g}: {v:.1f} ms = {c[f'{m}_verify_ratio'][g]:.2f}x"
          for g, v in c[f"{m}_verify_ms"].items())
      rows.append([m, _f(c[f"{m}_weight_gb"], ".2f"),
                   _f(c[f"{m}_roofline_ms"], ".1f"),
                   _f(c[f"{m}_forward_ms"], ".1f"),
                   _f(100 * c[f"{m}_forward_efficiency"], ".0f", "%"),
                   verify])
    lines.append(table(["model", "GB", "roofline ms", "forward ms",
                        "of roofline", "verify (γ+1 tokens) / forward"],
                       rows))
    # None where the decode phase was too short to time (prefill's median
    # at or above the whole call's, as tiny models on a noisy machine give).
    efficiency = base["roofline_efficiency"]
    lines.append(
        f"autoregressive decoding: {_f(base['decode_tokens_per_s'])} tok/s "
        "after the first token = "
        f"{_f(None if efficiency is None else 100 * efficiency, '.0f', '%')} "
        "of the target's roofline")
  return lines


def _matmul_lines(results: dict[str, Any]) -> list[str]:
  """Which matmul plan each model uses, and the timings behind it."""
  lines = []
  for m, info in (results.get("matmul") or {}).items():
    if not info:
      continue
    rows = info["rows"]
    timed = "; ".join(
        f"{name} " + "/".join(f"{t[str(r)]:.1f}" for r in rows) + " ms ("
        + "/".join(f"{info['ratio_to_first_rows'][name][str(r)]:.2f}x"
                   for r in rows[1:]) + ")"
        for name, t in info["timings_ms"].items())
    lines.append(f"matmul plan ({m}): {info['plan']} [{info['source']}]"
                 + (f"; layer stack at M={'/'.join(map(str, rows))} rows: "
                    f"{timed}" if timed else ""))
  choice = results.get("quantize")
  if choice:
    measured = "; ".join(
        f"{name}: layers {_ms_at(t)}, head {_ms_at(choice['head_ms'][name])}"
        for name, t in choice["model_ms"].items())
    lines.append(f"weights (target, quantize=auto): {choice['why']}"
                 + (f"; one forward's products: {measured}"
                    if measured else ""))
  return ([""] + lines) if lines else []


def _ms_at(ms: dict[str, float]) -> str:
  """{str(X): ms} -> "12.0/40.5 ms at 9/64 rows"."""
  return "/".join(f"{t:.1f}" for t in ms.values()) + (
      f" ms at {'/'.join(ms)} rows")


def format_report(results: dict[str, Any], per_prompt: bool = True) -> str:
  """The readable summary printed at the end of a run."""
  cfg, dev = results["config"], results["device"]
  prompts = results["prompts"]
  synthetic = " [SYNTHETIC acceptance]" if results.get("synthetic") else ""
  lines = [
      f"specjax speculative decoding: {_drafted_by(results)} -> target "
      f"{cfg['target']}{synthetic}",
      f"device {dev['platform']} ({dev['device_kind']}, "
      f"{dev.get('cpu_model', '?')}, "
      f"{dev['cpu_cores']} cores, jax {dev['jax_version']}), dtype "
      f"{results['models']['target'].get('dtype', cfg['dtype'])}, "
      f"prompts {prompts['set']} x{prompts['count']} "
      f"({'chat template' if prompts['chat_template'] else 'raw'}; "
      f"{prompts['source']}), N={cfg['max_new_tokens']}, "
      f"temperature={cfg['temperature']}",
      *_controls_line(results),
      "",
      "cost per forward (median of "
      f"{cfg['cost_repeats']}; c = draft / target; - : no draft model):",
  ]
  cost_rows = []
  for b, c in results["cost"].items():
    verify = ", ".join(f"{g}+1: {v:.1f} ms ({c['verify_cost_ratio'][g]:.2f}x)"
                       for g, v in c["target_verify_ms"].items())
    cost_rows.append([b, _f(c.get("draft_forward_ms"), ".2f"),
                      _f(c["target_forward_ms"], ".2f"),
                      _f(c.get("draft_cost_ratio"), ".3f"), verify])
  lines.append(table(["B", "draft ms", "target ms", "c",
                      "target verify (γ+1, or nodes+1, tokens)"], cost_rows))
  if results.get("memory"):
    lines += ["", "memory plan (weights, caches, logits and the widest "
              "pass's activations of the largest batch, per device; "
              "checked before compiling):",
              results["memory"]["table"]]
  lines += _roofline_lines(results)
  lines += _matmul_lines(results)
  lines += ["", "baseline vs speculative (tokens/s over all prompts):"]
  run_rows = []
  rules = any(r.get("acceptance", "exact") != "exact"
              for r in results["runs"])
  moe = any(r.get("experts_per_pass") is not None for r in results["runs"])
  for r in results["runs"]:
    run_rows.append([
        r.get("drafter", "model")] + ([_acceptance(r)] if rules else []) + [
        str(r["batch_size"]), str(r["gamma"]),
        str(r.get("num_nodes") or "-"), _f(r["acceptance_rate"], ".3f"),
        _f(r["mean_accepted_tokens"], ".2f"),
        _f(r.get("drafting_cost_per_step"), ".2f"),
        _f(r["baseline_tokens_per_s"], ".2f"),
        _f(r["spec_tokens_per_s"], ".2f"), _f(r["speedup"], ".2f", "x"),
        _f(r.get("decode_speedup"), ".2f", "x"),
        _f(r["predicted_speedup"], ".2f", "x"),
        _f(r.get("predicted_speedup_measured_verify"), ".2f", "x"),
        _f(r.get("predicted_speedup_extended"), ".2f", "x")]
        + ([_f(r.get("experts_per_pass"), ".2f")] if moe else [])
        + [_lossless(r)])
  lines.append(table(["drafter"] + (["acceptance"] if rules else []) + [
                      "B", "γ", "nodes", "α", "τ", "draft/step",
                      "base tok/s", "spec tok/s", "speedup", "decode",
                      "predicted", "pred. (verify)", "pred. (ext.)"]
                     + (["experts/pass"] if moe else []) + ["lossless"],
                     run_rows))
  if moe:
    lines.append("experts/pass: distinct experts a verification pass of "
                 "the mixture-of-experts target woke, per layer (a decode "
                 "step wakes k).")
  lines.append("draft/step: drafting cost per speculative step in target "
               "forwards (each component's forwards times its c). speedup: "
               "end to end, prompt passes included; decode: after the first "
               "token, the phase the prediction models. predicted: Leviathan"
               " et al. with measured α and c; pred. (verify): the same with "
               "the measured verify/forward time in place of 1; pred. (ext.):"
               " also with the measured drafted fractions and forwards per "
               "step of every drafter component (specjax.metrics). nodes: "
               "token-tree size (- a chain); α then counts depths (a depth "
               "accepted of those with a node), τ is the accepted path plus "
               "one. γ auto/heuristic: adaptive "
               "policies (specjax.policies); predictions assume a fixed "
               "chain. lossless: prompts whose greedy output equals the "
               "baseline's; `lossy` marks a lossy acceptance rule "
               "(typical, relaxed), never lossless; `rounding` a target "
               "with int8 activations off the CPU kernel's plan, exact "
               "only up to rounding (its prompts equal to the baseline's "
               "follow).")
  lines += _quality_lines(results)
  head = (f"{results.get('drafter', 'model')}, B={results['batch_size']}, "
          f"γ={results['gamma']}")
  if results.get("acceptance", "exact") != "exact":
    head += f", {_acceptance(results)}"
  lines += ["", f"per-position acceptance ({head}): " + " ".join(
      _f(a, ".3f") for a in results["per_position_acceptance"])]
  if per_prompt:
    rows = [[p["id"], str(p["prompt_tokens"]), str(p["spec_tokens"]),
             _f(p["acceptance_rate"], ".3f"),
             _f(p["mean_accepted_tokens"], ".2f"),
             _f(p["baseline_tokens_per_s"], ".2f"),
             _f(p["spec_tokens_per_s"], ".2f"), _f(p["speedup"], ".2f", "x"),
             p.get("finish_reason", "-"), _prompt_lossless(p, results)]
            for p in results["per_prompt"]]
    batched = " (tokens/s per batch)" if results["batch_size"] > 1 else ""
    lines += ["", f"per prompt ({head}){batched}:",
              table(["prompt", "P", "new", "α", "τ", "base tok/s",
                     "spec tok/s", "speedup", "finish", "lossless"], rows)]
  lines += ["", f"headline ({head}): α={_f(results['acceptance_rate'], '.3f')}"
            f" τ={_f(results['mean_accepted_tokens'], '.2f')} "
            f"c={_f(results['draft_cost_ratio'], '.3f')} speedup "
            f"{_f(results['speedup'], '.2f', 'x')}, decoding phase "
            f"{_f(results.get('decode_speedup'), '.2f', 'x')} (predicted "
            f"{_f(results['predicted_speedup'], '.2f', 'x')}), lossless="
            f"{results['lossless']}"
            + (" (int8 activations: exact up to rounding)"
               if results.get("rounding") else "") + "".join(
                f", {label} {_f(results[k], '.3f')} (autoregressive "
                f"{_f(results.get('baseline_' + k), '.3f')})"
                for k, label in (("json_valid_rate", "valid"),
                                 ("regex_match_rate", "regex"),
                                 ("pass_at_1", "pass@1"))
                if k in results)]
  return "\n".join(lines)


def _prompt_lossless(row: dict[str, Any], results: dict[str, Any]) -> str:
  """A per-prompt row's lossless cell (`lossy` under a lossy rule)."""
  if results.get("lossy"):
    return "lossy" + ("" if row.get("matches_baseline") is None else
                      " (= base)" if row["matches_baseline"] else
                      f" (@{row['first_mismatch']})")
  if row.get("matches_baseline") is None:
    return "n/a"
  equal = "yes" if row["matches_baseline"] else f"no @{row['first_mismatch']}"
  return f"rounding ({equal})" if results.get("rounding") else equal


# ------------------------------------------------------------------- plots


def _nan(x: Any) -> float:
  return float("nan") if x is None else float(x)


def save_plots(results: dict[str, Any],
               output_dir: str | os.PathLike) -> list[str]:
  """Writes the PNG plots and returns their file names.

  Always `acceptance_by_position.png` (one line per γ at the headline B);
  `speedup_vs_gamma.png` when γ is swept and `speedup_vs_batch.png` when the
  batch size is swept (measured and predicted, with the break-even line);
  `speedup_by_drafter.png` when drafters are compared;
  `acceptance_rules.png` when acceptance rules are (α, speedup, and
  pass@1 or the validity rate where scored). The others show the headline
  acceptance rule's runs.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  out = pathlib.Path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  # γ and batch sweeps of the headline drafter's fixed-γ chains; the
  # drafter plot has every drafter, the tree plot every tree size.
  same_rule = lambda r: (r.get("acceptance", "exact")
                         == results.get("acceptance", "exact"))
  runs = [r for r in results["runs"]
          if r.get("drafter") == results.get("drafter")
          and isinstance(r["gamma"], int) and same_rule(r)]
  chains = [r for r in runs if not r.get("num_nodes")]
  gammas, batches = results["sweep"]["gammas"], results["sweep"]["batch_sizes"]
  # Each plot is titled by what drafted: the headline drafter, or in the
  # drafter comparison every one.
  target = results["config"]["target"]
  suffix = " [synthetic]" if results.get("synthetic") else ""
  drafter = drafter_label(results.get("drafter", "model"), results["config"])
  title = f"{drafter} → {target}{suffix}"
  written = []

  def save(fig, name):
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    written.append(name)

  fig, ax = plt.subplots(figsize=(6, 4))
  for r in chains:
    if r["batch_size"] != results["batch_size"]:
      continue
    acc = [_nan(a) for a in r["per_position_acceptance"]]
    ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"γ={r['gamma']}")
  ax.set(xlabel="draft position", ylabel="acceptance (given proposed)",
         ylim=(0, 1.05), title=f"{title}\nB={results['batch_size']}")
  ax.xaxis.get_major_locator().set_params(integer=True)
  ax.legend()
  ax.grid(alpha=0.3)
  save(fig, "acceptance_by_position.png")

  def sweep_plot(xs, x_of, group_of, groups, xlabel, group_name, name):
    fig, ax = plt.subplots(figsize=(6, 4))
    for g in groups:
      sel = sorted((r for r in chains if group_of(r) == g), key=x_of)
      line, = ax.plot([x_of(r) for r in sel],
                      [_nan(r["speedup"]) for r in sel], marker="o",
                      label=f"measured, {group_name}={g}")
      ax.plot([x_of(r) for r in sel],
              [_nan(r.get("decode_speedup")) for r in sel], marker="s",
              ls=":", color=line.get_color(),
              label=f"measured decoding phase, {group_name}={g}")
      ax.plot([x_of(r) for r in sel],
              [_nan(r["predicted_speedup"]) for r in sel], ls="--",
              marker="x", color=line.get_color(),
              label=f"predicted, {group_name}={g}")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set(xlabel=xlabel, ylabel="speedup vs autoregressive", title=title,
           xticks=xs)
    if xlabel.startswith("batch"):
      ax.set_xscale("log", base=2)
      ax.set_xticks(xs, [str(x) for x in xs])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, name)

  if len(gammas) > 1:
    sweep_plot(gammas, lambda r: r["gamma"], lambda r: r["batch_size"],
               batches, "γ (draft tokens per step)", "B",
               "speedup_vs_gamma.png")
  if len(batches) > 1:
    sweep_plot(batches, lambda r: r["batch_size"], lambda r: r["gamma"],
               gammas, "batch size", "γ", "speedup_vs_batch.png")
  nodes = results["sweep"].get("num_nodes", [])
  if len(nodes) > 1:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for gamma in gammas:
      sel = sorted((r for r in runs if r["gamma"] == gamma
                    and r["batch_size"] == results["batch_size"]),
                   key=lambda r: r["num_nodes"])
      xs = [r["num_nodes"] or gamma for r in sel]  # a chain has γ nodes
      left.plot(xs, [_nan(r["mean_accepted_tokens"]) for r in sel],
                marker="o", label=f"γ={gamma}")
      right.plot(xs, [_nan(r["speedup"]) for r in sel], marker="o",
                 label=f"γ={gamma}, end to end")
      right.plot(xs, [_nan(r.get("decode_speedup")) for r in sel],
                 marker="s", ls=":", label=f"γ={gamma}, decoding phase")
    left.set(xlabel="draft tokens per step (tree nodes; chain = γ)",
             ylabel="τ (tokens per target pass)", title=title)
    right.set(xlabel="draft tokens per step (tree nodes; chain = γ)",
              ylabel="speedup vs autoregressive", title=title)
    for ax in (left, right):
      ax.set_xscale("log", base=2)
      ax.legend(fontsize=8)
      ax.grid(alpha=0.3)
    save(fig, "tree_nodes.png")
  names = results["sweep"].get("drafters", [])
  if len(names) > 1:
    head = [r for r in results["runs"]
            if r["batch_size"] == results["batch_size"]
            and r["gamma"] == results["gamma"] and same_rule(r)]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(head))
    for offset, key, label in ((-0.27, "speedup", "end to end"),
                               (0.0, "decode_speedup", "decoding phase"),
                               (0.27, "predicted_speedup_extended",
                                "predicted (ext.)")):
      ax.bar(x + offset, [_nan(r.get(key)) for r in head], width=0.27,
             label=label)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(x, [r["drafter"] for r in head])
    ax.set(ylabel="speedup vs autoregressive",
           title=textwrap.fill(f"{_drafted_by(results)} → {target}{suffix}",
                               55)
           + f"\nB={results['batch_size']}, γ={results['gamma']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save(fig, "speedup_by_drafter.png")
  rules = results["sweep"].get("acceptances", [])
  if len(rules) > 1:
    sel = [r for r in results["runs"]
           if r["batch_size"] == results["batch_size"]
           and r["gamma"] == results["gamma"]
           and r.get("drafter") == results.get("drafter")
           and not r.get("num_nodes")]
    score = next((k for k in ("pass_at_1", "json_valid_rate")
                  if any(k in r for r in sel)), None)
    panels = [("acceptance_rate", "α"), ("speedup", "speedup vs "
                                         "autoregressive")]
    if score:
      panels.append((score, "pass@1" if score == "pass_at_1"
                     else "validity rate"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    labels = [f"{r['acceptance']}\n(lossy)" if r.get("lossy")
              else r["acceptance"] for r in sel]
    for ax, (key, label) in zip(axes, panels):
      ax.bar(np.arange(len(sel)), [_nan(r.get(key)) for r in sel])
      if key == "speedup":
        ax.axhline(1.0, color="gray", lw=1)
      if key == score:
        base = results["baselines"][str(results["batch_size"])].get(key)
        ax.axhline(_nan(base), color="gray", lw=1, ls="--",
                   label="autoregressive")
        ax.legend(fontsize=8)
      ax.set_xticks(np.arange(len(sel)), labels, fontsize=8)
      ax.set(ylabel=label, title=f"{label}\n{results.get('drafter')}, "
             f"γ={results['gamma']}")
      ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    save(fig, "acceptance_rules.png")
  return written
