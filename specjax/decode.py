"""Public decoding API: `generate` and `speculative_generate`.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, N
max new tokens, G = γ.

Both take prompts as a list of token-id lists of different lengths and return
`tokens` [B, N] (generated ids only, `pad_id` after each row's end) and
`lengths` [B]. Each generation is one compiled call (`specjax.loops`):
prefill, then a `lax.while_loop` that runs until every row hit EOS or N
tokens. This module validates arguments, places models and rows on a mesh,
resolves the γ policy, and calls the loops.

Compile once per cache class: a program is fixed by B, γ, the models and
the cache size S, whose default is a power of two >= 256 holding the
longest prompt + N + γ + 1; the prompt buffer and the output buffer are
derived from S (`specjax.padding`), and the prompt's length and N are
traced. Prompts of 5 to 600 tokens with N <= 100 compile three programs per
(B, γ), and a call compiles nothing else: inputs travel as numpy arrays
and seeds become keys on the host (`tests/test_compile.py` counts every
backend compilation). Temperature, top-k, top-p, EOS ids, seeds, N and the
draft stop threshold are traced, so changing them never recompiles. Every
compilation is logged on the "specjax" logger with its time
(`specjax.compilation`); JAX's persistent compilation cache is turned on at
the first call (`$SPECJAX_CACHE/xla_cache`; `SPECJAX_NO_COMPILE_CACHE=1`
opts out), never at import, and `warmup` compiles ahead of time.

Models are anything implementing `specjax.models.LanguageModel` (a
`specjax.models.Model`, or an adapter around another Flax model); the draft
may also be any `specjax.drafters.Drafter`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from specjax import buffers
from specjax import compilation
from specjax import controls as controls_lib
from specjax import policies
from specjax import rejection
from specjax import sampling
from specjax import stops as stops_lib
from specjax import streaming
from specjax.drafters import DraftModel
from specjax.drafters import Drafter
from specjax.loops import generate_loop
from specjax.loops import prng_key
from specjax.loops import speculative_loop
from specjax.loops import synthetic_text
from specjax.models import LanguageModel
from specjax.padding import default_cache_size
from specjax.padding import cache_class
from specjax.padding import output_cap
from specjax.padding import prepare_prompts
from specjax.padding import prompt_bucket
from specjax.sharding.batch import Placement
from specjax.step_types import SpecStats
from specjax.step_types import StepParams

__all__ = [
    "GenerateOutput", "SpecOutput", "SpecStats", "StepParams",
    "cache_class", "default_cache_size", "generate", "prepare_prompts",
    "prompt_bucket", "resolve_policy",
    "speculative_generate", "synthetic_text", "warmup",
]


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """Result of `generate`.

  Attributes:
    tokens: [B, N] int32 generated ids, `pad_id` after each row's end.
    lengths: [B] int32 generated tokens per row (an EOS is counted and
      kept, and so is the token that completes a stop string).
    finish_reason: per row, "eos" (it emitted an EOS id), "stop" (a stop
      string) or "length" (N tokens).
    lossless: False when a lossy acceptance rule was used (the output is
      then not distributed as the target's).
    stop: the stop strings of the call (`text` cuts at them).
  """

  tokens: np.ndarray
  lengths: np.ndarray
  finish_reason: tuple[str, ...] = ()
  lossless: bool = True
  stop: tuple[str, ...] = ()

  def row(self, b: int) -> list[int]:
    """The tokens generated for row b, without padding."""
    return self.tokens[b, :self.lengths[b]].tolist()

  def text(self, tokenizer: Any, b: int) -> str:
    """Row b decoded, cut where its stop string ends (the token that
    completes one may carry text past it)."""
    text = tokenizer.decode(self.row(b))
    return stops_lib.truncate_text(text, self.stop) if self.stop else text


@dataclasses.dataclass(frozen=True)
class SpecOutput(GenerateOutput):
  """Result of `speculative_generate`.

  Attributes:
    stats: counters (see `specjax.speculate.SpecStats`), as numpy arrays.
    gamma: γ used (γ_max under an adaptive policy).
    policy: "" for a fixed γ, else the adaptive policy ("auto",
      "heuristic").
    synthetic: True when acceptance was synthetic (fixed-rate, not
      distribution-preserving): such figures must be labelled synthetic.
    policy_state: the policy's final state (`policies.PolicyState`,
      numpy; None for a fixed γ): `policy.warm(policy_state)` carries
      what it learned into the next call.
  """

  stats: SpecStats = None
  gamma: int = 0
  synthetic: bool = False
  policy: str = ""
  policy_state: Any = None


def _check_model(model: Any, name: str, drafter_too: bool = False) -> None:
  """A clear error for a `model` argument that is not a `LanguageModel`
  (or, with `drafter_too`, a `Drafter` either)."""
  kinds = (Drafter, LanguageModel) if drafter_too else (LanguageModel,)
  if isinstance(model, kinds):
    return
  hint = (" (a name or path: load it first, e.g. "
          "specjax.registry.load_pretrained)"
          if isinstance(model, (str, bytes)) else "")
  wanted = ("a specjax.models.LanguageModel or a specjax.drafters.Drafter "
            "subclass" if drafter_too else "a specjax.models.LanguageModel "
            "(vocab_size, init_cache, __call__, prefill)")
  raise TypeError(f"{name} must be {wanted}, got {type(model).__name__} "
                  f"{model!r:.60}{hint}.")


def _check_eos(eos_id: int | Sequence[int] | None, vocab_size: int) -> None:
  """EOS ids must be token ids of the model's vocabulary."""
  ids = [] if eos_id is None else (
      [eos_id] if isinstance(eos_id, (int, np.integer)) else list(eos_id))
  bad = [i for i in ids if not 0 <= int(i) < vocab_size]
  if bad:
    raise ValueError(f"eos_id {bad} outside the vocabulary [0, "
                     f"{vocab_size}).")


def generate(model: LanguageModel, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | Sequence[int] | None = None,
             key: jax.Array | int | None = None,
             cache_size: int | None = None,
             pad_id: int = 0,
             tokens_cap: int | None = None,
             mesh: jax.sharding.Mesh | None = None,
             stop: Sequence[str] | None = None,
             repetition_penalty: float | None = None,
             presence_penalty: float | None = None,
             frequency_penalty: float | None = None,
             logit_bias: dict[int, float] | None = None,
             min_p: float | None = None, regex: str | None = None,
             json_schema: dict[str, Any] | str | None = None,
             on_tokens: Any = None, tokenizer: Any = None
             ) -> GenerateOutput:
  """Batched autoregressive decoding, compiled as one call.

  Args:
    model: a `LanguageModel` (e.g. `specjax.models.Model`).
    prompts: B lists of token ids, of any lengths >= 1.
    max_new_tokens: N, the most tokens generated per row.
    temperature: 0 for greedy; otherwise softmax temperature.
    top_k: keep the k most likely tokens (0 disables).
    top_p: nucleus mass in (0, 1] (1 disables).
    eos_id: one id or several; a row stops after emitting one.
    key: PRNG key or int seed (default seed 0).
    cache_size: S; default the class of the longest prompt + N + 1 (a
      power of two >= 256; module doc). It fixes the program.
    pad_id: written after each row's end.
    tokens_cap: N_cap, the static output width (>= N); default S.
    mesh: run over this `specjax.sharding.make_mesh` mesh (the model is
      placed on it if it is not yet; default: the mesh the model was
      placed on by `specjax.sharding.shard`, or one device). B need not
      divide the data axis (`specjax.sharding.batch`).

  Generation controls (each None is off and costs nothing; any value is
  traced, so changing it never recompiles; `specjax.controls`):
    stop: stop strings, matched on the text the tokens decode to, across
      tokens and steps (`specjax.stops`); a row ends with the token that
      completes one (`text` cuts the text where it ends). Needs
      `tokenizer`.
    repetition_penalty: Hugging Face's ρ > 0 over the prompt and output.
    presence_penalty, frequency_penalty: the OpenAI penalties in [-2, 2]
      over the output.
    logit_bias: {token id: bias in [-100, 100]} added to the logits.
    min_p: keep tokens with at least min_p times the top probability.
    regex, json_schema: constrain the output to a regular expression or a
      JSON schema (a dict or JSON string), compiled to a token automaton
      by outlines-core (`specjax.grammar`). Needs `tokenizer` and
      `eos_id`.
    on_tokens: a callback given, after the prefill and after every step,
      each row's newly committed token ids (B lists; `specjax.streaming`;
      `streaming.TextStream` decodes them).
    tokenizer: the model's `specjax.tokenizer.Tokenizer`, for `stop`,
      `regex` and `json_schema`.

  Returns:
    `GenerateOutput` with tokens [B, N], lengths [B] and finish reasons.
  """
  _check_model(model, "model")
  _check_eos(eos_id, model.vocab_size)
  controls, stops = controls_lib.resolve(
      model.vocab_size, tokenizer=tokenizer, eos_id=eos_id, stop=stop,
      repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty,
      frequency_penalty=frequency_penalty, logit_bias=logit_bias,
      regex=regex, json_schema=json_schema)
  params = sampling.SamplingParams.create(temperature, top_k, top_p,
                                          min_p=min_p, controls=controls)
  tokens, lengths, cache_size = prepare_prompts(
      prompts, model.vocab_size, max_new_tokens=max_new_tokens,
      cache_size=cache_size, reserve=1,
      tokens_cap=_checked_cap(max_new_tokens, tokens_cap))
  cap = output_cap(max_new_tokens, tokens_cap, cache_size)
  where, (model,) = Placement.resolve(mesh, len(tokens), model)
  where.check_memory({"model": model}, cache_size=cache_size, chunk=1)
  tokens, lengths, budget = where.inputs(tokens, lengths, max_new_tokens)
  with streaming.open_stream(on_tokens) as stream_id:
    out, counts = compilation.call(
        generate_loop, "generate",
        f"B={tokens.shape[0]}, S={cache_size}, N_cap={cap}", model, tokens,
        lengths, params, buffers.eos_array(eos_id), prng_key(key), budget,
        stops, stream_id, tokens_cap=cap, cache_size=cache_size,
        pad_id=pad_id)
  out, counts = where.rows((out, counts))
  return GenerateOutput(
      tokens=out[:, :max_new_tokens], lengths=counts,
      finish_reason=_finish_reasons(out, counts, eos_id, stops),
      stop=tuple(stop or ()))


def _finish_reasons(tokens: np.ndarray, lengths: np.ndarray, eos_id: Any,
                    stops: Any) -> tuple[str, ...]:
  """Per row: "eos" if its last token is an EOS id, "stop" if a stop
  string ends at it, else "length"."""
  eos = set(buffers.eos_array(eos_id).tolist())
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  reasons = []
  for row, n in zip(tokens, lengths):
    if n and int(row[n - 1]) in eos:
      reasons.append("eos")
    elif n and stops is not None and stops_lib.stop_index(
        stops, row[:n]) == n - 1:
      reasons.append("stop")
    else:
      reasons.append("length")
  return tuple(reasons)


def _checked_cap(max_new_tokens: int, tokens_cap: int | None
                 ) -> int | None:
  """`tokens_cap`, validated against N before it sizes the cache."""
  if tokens_cap is not None:
    output_cap(max_new_tokens, tokens_cap, 0)
  return tokens_cap


def resolve_policy(gamma: int | str | policies.GammaPolicy, *,
                   max_gamma: int, target: LanguageModel, drafter: Drafter,
                   batch: int, cache_size: int,
                   num_nodes: int | None = None) -> policies.GammaPolicy:
  """The γ policy for a `gamma` argument of `speculative_generate`.

  An int is `Fixed(gamma)` (with `num_nodes`, a token tree); "heuristic"
  is `Heuristic(max_gamma)`; "auto" is `Auto` priced for B = `batch` and S
  = `cache_size` by `StepCosts.for_call` (the tuning step's tables, else
  the roofline: nothing is timed); a `GammaPolicy` is used as is.

  Raises:
    ValueError: an invalid `gamma`.
  """
  _gamma_bound(gamma, max_gamma=max_gamma)  # validates
  if isinstance(gamma, policies.GammaPolicy):
    return gamma
  if gamma == "heuristic":
    return policies.Heuristic(max_gamma)
  if gamma == "auto":
    return policies.Auto.from_costs(policies.StepCosts.for_call(
        target, drafter.cost_model, batch=batch, cache_size=cache_size,
        max_gamma=max_gamma))
  return policies.Fixed(int(gamma), num_nodes)


def _gamma_bound(gamma: int | str | policies.GammaPolicy, *,
                 max_gamma: int) -> int:
  """G, the most drafts a step may verify, for a `gamma` argument of
  `speculative_generate` (validated)."""
  if isinstance(gamma, policies.GammaPolicy):
    return gamma.max_gamma
  if isinstance(gamma, str):
    if gamma in ("auto", "heuristic"):
      return max_gamma
  elif not isinstance(gamma, bool) and int(gamma) == gamma and gamma >= 1:
    return int(gamma)
  raise ValueError(f"gamma must be an integer >= 1, 'auto' or "
                   f"'heuristic', got {gamma!r}.")


def speculative_generate(
    target: LanguageModel, draft: LanguageModel | Drafter,
    prompts: Sequence[Sequence[int]], *,
    gamma: int | str | policies.GammaPolicy, max_new_tokens: int,
    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    key: jax.Array | int | None = None, cache_size: int | None = None,
    pad_id: int = 0, draft_stop_threshold: float = 0.0,
    synthetic_acceptance: float | None = None,
    tokens_cap: int | None = None, max_gamma: int = 8,
    num_nodes: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    stop: Sequence[str] | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_p: float | None = None, regex: str | None = None,
    json_schema: dict[str, Any] | str | None = None,
    on_tokens: Any = None, tokenizer: Any = None,
    acceptance: str = "exact", typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
    acceptance_threshold: float = 0.5) -> SpecOutput:
  """Speculative decoding, compiled as one call.

  The output is distributed exactly as `generate(target, ...)` with the same
  sampling settings; with temperature 0 it equals it token for token (up to
  floating-point near-ties between a one-token and a (γ+1)-token pass).

  Args:
    target: the `LanguageModel` whose distribution is sampled.
    draft: a smaller `LanguageModel` with the same vocabulary, or any
      `Drafter`.
    prompts: B lists of token ids, of any lengths >= 1.
    gamma: γ >= 1, draft tokens proposed per step; or "auto" (a
      cost-model policy choosing 0 to `max_gamma` drafts each step from
      running acceptance estimates and forward costs measured on this
      machine), "heuristic" (transformers' +2/-1 schedule up to
      `max_gamma`), or a `specjax.policies.GammaPolicy`. Any policy keeps
      the output exact; see `specjax.policies`. A policy that could never
      draft at these costs (`GammaPolicy.may_draft`) runs `generate`.
    max_new_tokens: N.
    temperature: 0 for greedy; applied to draft and target alike.
    top_k: keep the k most likely tokens (0 disables).
    top_p: nucleus mass in (0, 1] (1 disables).
    eos_id: one id or several; a row stops after emitting one.
    key: PRNG key or int seed (default seed 0).
    cache_size: S for both models; must hold the longest prompt + N + γ + 1.
    pad_id: written after each row's end.
    draft_stop_threshold: stop drafting a row early when the draft's top
      probability falls below this (0 never stops).
    synthetic_acceptance: if set, accept each draft token with this fixed
      probability instead of verifying it (system benchmarks on random
      weights only: the output is then NOT the target's distribution).
    tokens_cap: N_cap, as in `generate`.
    max_gamma: γ_max for "auto" and "heuristic".
    num_nodes: None drafts a chain of γ tokens per step; T makes a tree
      drafter (`DraftModel`, `PromptLookup`) propose a token tree of at
      most T nodes at depth at most γ, verified in one target pass of T + 1
      tokens (`specjax.tree`); the cache must hold T + 1 positions past N.
    mesh: as in `generate`; a draft `Model` not yet placed is replicated
      on it (`specjax.sharding.shard(draft, mesh, split=False)`; place it
      split yourself to split it), and a `Drafter` must hold models placed
      on the same mesh.
    stop, repetition_penalty, presence_penalty, frequency_penalty,
      logit_bias, min_p, regex, json_schema, on_tokens, tokenizer: the
      generation controls, as in `generate`. The draft's q and the
      target's p at every draft position (tree nodes included) read the
      history through the drafted prefix there, so the output stays exact
      under every control (`specjax.controls`).
    acceptance: "exact" (rejection sampling), or a lossy rule that is NOT
      distribution-preserving and labels the output `lossless=False`:
      "typical" (Medusa's typical acceptance with `typical_epsilon` ε and
      `typical_delta` δ) or "relaxed" (the tunable threshold λ =
      `acceptance_threshold`; `rejection.Lossy`). Chains only.

  Returns:
    `SpecOutput` with tokens [B, N], lengths [B], finish reasons and
    statistics.
  """
  _check_model(target, "target")
  _check_model(draft, "draft", drafter_too=True)
  where, (target, draft) = Placement.resolve(mesh, len(prompts), target,
                                             draft)
  drafter = draft if isinstance(draft, Drafter) else DraftModel(draft)
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(
        f"Draft and target vocabularies differ: draft has "
        f"{drafter.vocab_size} tokens, target has {target.vocab_size}. "
        "Speculative decoding needs one shared tokenizer.")
  _check_eos(eos_id, target.vocab_size)
  bound = _gamma_bound(gamma, max_gamma=max_gamma)
  _check_tree(num_nodes, bound, gamma, drafter)
  lossy = None
  if acceptance != "exact":
    lossy = rejection.Lossy.create(acceptance, epsilon=typical_epsilon,
                                   delta=typical_delta,
                                   threshold=acceptance_threshold)
    if num_nodes is not None:
      raise ValueError(f"acceptance={acceptance!r} verifies chains only; "
                       "token trees (num_nodes) use exact acceptance.")
  controls = dict(stop=stop, repetition_penalty=repetition_penalty,
                  presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                  regex=regex, json_schema=json_schema)
  step_controls, stops = controls_lib.resolve(
      target.vocab_size, tokenizer=tokenizer, eos_id=eos_id, **controls)
  params = StepParams.create(
      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
      draft_stop_threshold=draft_stop_threshold,
      synthetic_acceptance=synthetic_acceptance, min_p=min_p,
      controls=step_controls, stops=stops, lossy=lossy)
  synthetic = synthetic_acceptance is not None
  extra = drafter.extra_positions
  tokens, lengths, cache_size = prepare_prompts(
      prompts, target.vocab_size, max_new_tokens=max_new_tokens,
      cache_size=cache_size, reserve=(num_nodes or bound) + 1 + extra,
      tokens_cap=_checked_cap(max_new_tokens, tokens_cap),
      reserve_note=f" (gamma + 1, and {extra} for the drafter's inner "
      "levels: a Cascade's inner gamma + 1)" if extra else (
          " (num_nodes + 1)" if num_nodes else ""))
  cap = output_cap(max_new_tokens, tokens_cap, cache_size)
  where.check_memory({"target": target, "draft": draft},
                     cache_size=cache_size, chunk=(num_nodes or bound) + 1)
  policy = resolve_policy(gamma, max_gamma=max_gamma, target=target,
                          drafter=drafter, batch=len(prompts),
                          cache_size=cache_size, num_nodes=num_nodes)
  gamma = policy.max_gamma
  if not policy.may_draft():
    # No acceptance could make drafting pay at this B on this machine: the
    # fallback is `generate` itself, with no draft prefill or loop overhead.
    base = generate(target, prompts, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p,
                    eos_id=eos_id, key=key, cache_size=cache_size,
                    pad_id=pad_id, tokens_cap=cap, min_p=min_p,
                    on_tokens=on_tokens, tokenizer=tokenizer, **controls)
    return SpecOutput(
        tokens=base.tokens, lengths=base.lengths,
        finish_reason=base.finish_reason, stop=base.stop, stats=(
            SpecStats.autoregressive(base.lengths, gamma, max(cap - 1, 1),
                                     drafter.components)),
        gamma=int(gamma), synthetic=synthetic, policy=_policy_name(policy),
        policy_state=jax.device_get(policy.init(len(prompts))))
  tokens, lengths, budget = where.inputs(tokens, lengths, max_new_tokens)
  with streaming.open_stream(on_tokens) as stream_id:
    out, counts, stats, policy_state = compilation.call(
        speculative_loop, "speculative_generate",
        f"B={tokens.shape[0]}, S={cache_size}, N_cap={cap}, "
        f"gamma={gamma}{_policy_name(policy, ' ')}"
        f"{f', num_nodes={num_nodes}' if num_nodes else ''}", target,
        drafter, tokens, lengths, params, prng_key(key), budget, policy,
        stream_id, tokens_cap=cap, cache_size=cache_size, pad_id=pad_id,
        synthetic=synthetic, num_nodes=num_nodes)
  out, counts, policy_state = where.rows((out, counts, policy_state))
  stats = stats.replace(**where.rows(
      dict(accepted=stats.accepted, proposed=stats.proposed,
           scored=stats.scored)))
  return SpecOutput(tokens=out[:, :max_new_tokens], lengths=counts,
                    finish_reason=_finish_reasons(out, counts, eos_id,
                                                  stops),
                    lossless=lossy is None, stop=tuple(stop or ()),
                    stats=where.totals(stats), gamma=int(gamma),
                    synthetic=synthetic, policy=_policy_name(policy),
                    policy_state=policy_state)


def _check_tree(num_nodes: int | None, gamma: int,
                requested: int | str | policies.GammaPolicy,
                drafter: Drafter) -> None:
  """Errors for `num_nodes` with G = `gamma` and the `gamma` argument as
  `requested` (an int, or an adaptive policy or its name)."""
  if num_nodes is None:
    return
  if isinstance(num_nodes, bool) or int(num_nodes) != num_nodes or (
      num_nodes < gamma):
    raise ValueError(f"num_nodes must be an integer >= gamma={gamma} (one "
                     f"node per depth at least), got {num_nodes!r}.")
  if isinstance(requested, (str, policies.GammaPolicy)):
    name = (requested if isinstance(requested, str)
            else _policy_name(requested))
    raise ValueError("num_nodes (token trees) takes a fixed integer gamma, "
                     f"not an adaptive policy ({name}).")
  if not drafter.supports_trees:
    raise ValueError(f"{type(drafter).__name__} drafts chains only; token "
                     "trees (num_nodes) need a tree drafter: DraftModel or "
                     "PromptLookup.")


def _policy_name(policy: policies.GammaPolicy, prefix: str = "") -> str:
  """"" for a fixed γ, else the policy's name ("auto", "heuristic")."""
  if isinstance(policy, policies.Fixed):
    return ""
  return prefix + type(policy).__name__.lower()


def warmup(target: LanguageModel, draft: LanguageModel | Drafter | None = None,
           *, batch: int, prompt_len: int, max_new_tokens: int,
           gamma: int | None = None, cache_size: int | None = None,
           eos_id: int | Sequence[int] | None = None) -> int:
  """Compiles ahead of time what later calls with these shapes will run.

  Runs `generate` (and `speculative_generate` when `draft` and `gamma` are
  given) once on dummy prompts of `prompt_len` tokens with one new token,
  in the cache a call with `max_new_tokens` gets (its class, or
  `cache_size`): N and the prompt's length are traced within it, so the
  program is the one such calls use, and the run itself is one prefill and
  one step. With the persistent compilation cache on, later processes
  reuse it too.

  Returns:
    The number of programs compiled.
  """
  before = compilation.num_compiled()
  prompts = [[0] * prompt_len] * batch
  size = lambda reserve: cache_size or default_cache_size(
      prompt_len, max_new_tokens, reserve)
  generate(target, prompts, max_new_tokens=1, cache_size=size(1),
           eos_id=eos_id)
  if draft is not None and gamma is not None:
    drafter = draft if isinstance(draft, Drafter) else DraftModel(draft)
    speculative_generate(
        target, draft, prompts, gamma=gamma, max_new_tokens=1,
        cache_size=size(gamma + 1 + drafter.extra_positions), eos_id=eos_id)
  return compilation.num_compiled() - before
