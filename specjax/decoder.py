"""`SpeculativeDecoder`: one object for plain and speculative decoding.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, N
max new tokens, N_cap its static cap, G = γ; B_pad is B rounded up to the
mesh's data axis (`specjax.sharding.batch`).

```python
target, tok = registry.load_pretrained("qwen2.5-coder-1.5b-instruct")
draft, _ = registry.load_pretrained("qwen2.5-coder-0.5b-instruct")
decoder = SpeculativeDecoder(target, drafter=draft, tokenizer=tok)
out = decoder.generate(["def quicksort(xs):\\n"], max_new_tokens=64)
print(out.texts[0], metrics.summarize(out))
```

A decoder holds what stays fixed across calls (the models, the γ policy,
the tokenizer, `SamplingConfig`, EOS ids, cache size, mesh); `generate`
takes what changes per call (prompts, N, key). Without a drafter it is
plain autoregressive decoding. `generate` runs three named stages, as
gemma's `gm.text.Sampler` does:

1. `prepare`: validates the call, encodes text prompts, pads the prompts
   (`specjax.padding`), places models and rows on a mesh, checks the memory
   plan and chooses the γ policy, into one `Prepared` record;
2. `run`: the compiled loop, one call (`specjax.loops.generate_loop`
   without a drafter, or where the policy could never draft at these
   costs; else `speculative_loop`), then the numpy outputs
   (`specjax.outputs`);
3. the text: each row decoded by the tokenizer (`GenerateOutput.texts`).

Defaults follow gemma's sampler, vLLM's `SamplingParams` and HF `generate`:

- greedy decoding (`SamplingConfig()`);
- EOS ids from the tokenizer (`eos_ids`) when `eos_id` is not given;
  `eos_id=()` runs every row to N;
- `key=None` draws a fresh seed per call (gemma's `Sampler.sample(rng=None)`,
  vLLM's `seed=None`); the output records it, so `key=out.seed` repeats a
  call, and `key=0` is always the same. Greedy decoding without synthetic
  acceptance reads no key.

`decode.generate` and `decode.speculative_generate` are this object, built
for one call.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Mapping, Protocol, Sequence

import jax
import numpy as np

from specjax import acceptance as acceptance_lib
from specjax import compilation
from specjax import controls as controls_lib
from specjax import policies
from specjax import sampling
from specjax import streaming
from specjax.acceptance import Acceptance
from specjax.arguments import check_eos
from specjax.arguments import check_model
from specjax.arguments import check_tree
from specjax.arguments import gamma_bound
from specjax.arguments import policy_name
from specjax.arguments import resolve_policy
from specjax.drafters import DraftModel
from specjax.drafters import Drafter
from specjax.loops import generate_loop
from specjax.loops import speculative_loop
from specjax.models import LanguageModel
from specjax.outputs import finish_reasons
from specjax.outputs import GenerateOutput
from specjax.outputs import SpecOutput
from specjax.padding import check_max_new_tokens
from specjax.padding import output_cap
from specjax.padding import prepare_prompts
from specjax.padding import prompt_rows
from specjax.processors import Processor
from specjax.sharding.batch import Placement
from specjax.step_types import SpecStats
from specjax.step_types import StepParams

__all__ = ["Prepared", "SamplingConfig", "SpeculativeDecoder",
           "TextTokenizer"]


class TextTokenizer(Protocol):
  """What a decoder asks of its tokenizer (`specjax.tokenizer.Tokenizer`
  has it all): `encode` for text prompts, `decode` for `texts`, `eos_ids`
  for the EOS default, `special_ids` for prompt lookup's control tokens
  (`PromptLookup.control_ids`), `token_bytes` for `stop`, `regex` and
  `json_schema`."""

  eos_ids: Sequence[int]
  special_ids: Sequence[int]

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def token_bytes(self) -> list[bytes]: ...


_SAMPLERS = ("temperature", "top_k", "top_p", "min_p")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How each token is chosen: the sampler and the generation controls.

  One record, like vLLM's `SamplingParams`. Every value is traced, so
  changing it never recompiles, and a control left at None is not in the
  program at all (`specjax.controls`). Under speculation every setting
  applies to the draft's q and the target's p alike, so the output stays
  exact.

  Attributes:
    temperature: 0 for greedy; otherwise softmax temperature.
    top_k: keep the k most likely tokens (0 disables).
    top_p: nucleus mass in (0, 1] (1 disables).
    min_p: keep tokens with at least min_p times the top probability.
    repetition_penalty: Hugging Face's ρ > 0 over the prompt and output.
    presence_penalty: the OpenAI penalty in [-2, 2] over the output.
    frequency_penalty: the OpenAI penalty in [-2, 2] over the output.
    logit_bias: {token id: bias in [-100, 100]} added to the logits.
    stop: stop strings, matched on the text the tokens decode to, across
      tokens and steps (`specjax.stops`); a row ends with the token that
      completes one. Needs a tokenizer.
    regex: constrain the output to this regular expression
      (`specjax.grammar`). Needs a tokenizer and EOS ids.
    json_schema: constrain the output to this JSON schema (a dict or a
      JSON string). Needs a tokenizer and EOS ids.
    processors: your own `specjax.processors.Processor`s, applied after
      the built-in controls and before a grammar's mask.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float | None = None
  repetition_penalty: float | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: Mapping[int, float] | None = None
  stop: Sequence[str] | None = None
  regex: str | None = None
  json_schema: Mapping[str, Any] | str | None = None
  processors: Sequence[Processor] = ()

  @classmethod
  def from_keywords(cls, caller: str, **keywords: Any) -> "SamplingConfig":
    """The config of a call's sampling keywords (HF `generate`'s
    `**kwargs` to its `GenerationConfig`); an unknown one is an error
    naming `caller` and the keywords it takes."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(keywords) - set(names))
    if unknown:
      raise TypeError(f"{caller}() got unexpected keyword arguments "
                      f"{unknown}; its sampling keywords are {names}.")
    return cls(**keywords)

  def controls(self) -> dict[str, Any]:
    """The control settings, as `controls.resolve` takes them."""
    return {k: v for k, v in vars(self).items() if k not in _SAMPLERS}


def _sampling_key(key: jax.Array | int | None
                  ) -> tuple[jax.Array, int | None]:
  """The PRNG key and the int seed it came from (None for a key array);
  None draws a seed, as gemma's sampler does. Keys are made on the host
  (`sampling.host_key`), so no call compiles a seeding program."""
  if key is None:
    key = random.randrange(2**31)
  if isinstance(key, (int, np.integer)):
    return sampling.host_key(key), int(key)
  return key, None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
  """One call, validated and laid out for its compiled loop.

  Attributes:
    where: the `Placement` (the mesh and B).
    target: the target, placed.
    drafter: the `Drafter` that drafts, or None for plain decoding.
    policy: the γ policy, or None for plain decoding.
    tokens: [B_pad, P] int32 padded prompts (numpy; global arrays on a
      mesh).
    lengths: [B_pad] int32 prompt lengths.
    longest: the longest prompt's length (host).
    budget: N as [] int32, or [B_pad] int32 with 0 for rows the mesh added.
    params: `StepParams`: the sampler, controls, EOS ids and stop strings.
    key: the PRNG key.
    seed: the int seed of `key`, or None.
    max_new_tokens: N.
    cache_size: S.
    tokens_cap: N_cap.
  """

  where: Placement
  target: LanguageModel
  drafter: Drafter | None
  policy: policies.GammaPolicy | None
  tokens: Any
  lengths: Any
  longest: int
  budget: Any
  params: StepParams
  key: jax.Array
  seed: int | None
  max_new_tokens: int
  cache_size: int
  tokens_cap: int

  @property
  def drafts(self) -> bool:
    """Whether the call runs the speculative loop. A policy that could
    never draft at these costs, or whose drafts could never repay the
    draft model's prefill (priced by the roofline at the passes it runs
    for the longest prompt, `Roofline.prefill_ms`) over N tokens, runs
    the plain one."""
    if self.policy is None:
      return False
    model = self.drafter.cost_model
    prefill = 0.0 if model is None else policies.Roofline.cached(
        ).prefill_ms(model, batch=self.tokens.shape[0],
                     width=self.tokens.shape[1], cache_size=self.cache_size,
                     longest=self.longest)
    return self.policy.may_draft(self.max_new_tokens, prefill)


@dataclasses.dataclass(frozen=True, eq=False)
class SpeculativeDecoder:
  """Decodes from `target`, speculatively when it has a drafter.

  The output is distributed exactly as the target's under `sampling`
  (drafter or not); with temperature 0 it equals plain decoding token for
  token (up to floating-point near-ties between a one-token and a
  (γ+1)-token pass).

  Attributes:
    target: the `LanguageModel` whose distribution is sampled.
    drafter: a smaller `LanguageModel` with the target's vocabulary (a
      `DraftModel`), any `specjax.drafters.Drafter` (`PromptLookup()`
      takes its vocabulary from the target), or None: plain
      autoregressive decoding.
    gamma: γ >= 1 draft tokens per step; "auto" (a cost-model policy
      choosing 0 to `max_gamma` drafts each step), "heuristic"
      (transformers' +2/-1 schedule) or a `specjax.policies.GammaPolicy`.
      A policy that could never draft at these costs runs plain decoding.
    tokenizer: the model's tokenizer (`registry.load_pretrained` returns
      it with the model; `TextTokenizer`): text prompts, `texts`, the EOS
      default and the text-level controls (`stop`, `regex`,
      `json_schema`).
    sampling: the sampler and the generation controls (`SamplingConfig`;
      greedy by default).
    eos_id: one id or several; a row stops after emitting one. None: the
      tokenizer's `eos_ids` (none without a tokenizer); (): none.
    acceptance: the rule that judges drafts (`specjax.acceptance`):
      "exact" (rejection sampling); a lossy rule, NOT
      distribution-preserving, that labels the output `lossless=False`
      ("typical" or "relaxed" with default settings, or `Typical.create`,
      `Relaxed.create` with your own; chains only); or
      `Synthetic.create(rate)`, which keeps each draft with a fixed
      probability (timing random weights only; labels the output
      `synthetic`).
    num_nodes: None drafts a chain of γ tokens per step; T makes a tree
      drafter (`DraftModel`, `PromptLookup`) propose a token tree of at
      most T nodes at depth at most γ, verified in one target pass.
    max_gamma: γ_max for "auto" and "heuristic".
    draft_stop_threshold: stop drafting a row early when the draft's top
      probability falls below this (0 never stops).
    cache_size: S for every model; default the class of the longest
      prompt + N + γ + 1 (`specjax.padding`). It fixes the program.
    tokens_cap: N_cap, the static output width (>= N); default S.
    pad_id: written after each row's end.
    mesh: run over this `specjax.sharding.make_mesh` mesh (models not yet
      placed are placed on it: the target split, a draft replicated);
      default the mesh the models were placed on, or one device.
  """

  target: LanguageModel
  _: dataclasses.KW_ONLY
  drafter: LanguageModel | Drafter | None = None
  gamma: int | str | policies.GammaPolicy = 4
  tokenizer: TextTokenizer | None = None
  sampling: SamplingConfig = SamplingConfig()
  eos_id: int | Sequence[int] | None = None
  acceptance: str | Acceptance = "exact"
  num_nodes: int | None = None
  max_gamma: int = 8
  draft_stop_threshold: float = 0.0
  cache_size: int | None = None
  tokens_cap: int | None = None
  pad_id: int = 0
  mesh: jax.sharding.Mesh | None = None

  def __post_init__(self):
    check_model(self.target, "target")
    if self.drafter is not None:
      check_model(self.drafter, "drafter", drafter_too=True)
      gamma_bound(self.gamma, max_gamma=self.max_gamma)  # validates
    if not isinstance(self.sampling, SamplingConfig):
      raise TypeError("sampling must be a specjax.decoder.SamplingConfig, "
                      f"got {type(self.sampling).__name__}.")

  def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str] | str,
               *, max_new_tokens: int, key: jax.Array | int | None = None,
               on_tokens: Any = None) -> GenerateOutput | SpecOutput:
    """Generates up to N tokens after each prompt, in one compiled call.

    Args:
      prompts: B prompts: lists of token ids of any lengths >= 1, or, with
        a tokenizer, strings (one string is a batch of one).
      max_new_tokens: N, the most tokens generated per row.
      key: PRNG key or int seed. None draws a fresh seed (module
        docstring), recorded in `out.seed`; pass `key=0` (or any int) for
        the same samples on every call.
      on_tokens: a callback given, after the prefill and after every step,
        each row's newly committed token ids (B lists;
        `specjax.streaming`; `streaming.TextStream` decodes them).

    Returns:
      `SpecOutput` with a drafter, else `GenerateOutput`: tokens [B, N],
      lengths [B], finish reasons, the seed and, with a tokenizer, `texts`.
    """
    call = self.prepare(prompts, max_new_tokens=max_new_tokens, key=key)
    out = self.run(call, on_tokens=on_tokens)
    return out if self.tokenizer is None else out.with_texts(self.tokenizer)

  def prepare(self, prompts: Any, *, max_new_tokens: int,
              key: jax.Array | int | None = None) -> Prepared:
    """Stage 1: the call validated, padded, placed and planned.

    Raises:
      ValueError: bad prompts or N (`specjax.padding.prompt_rows`), EOS
        ids outside the vocabulary, mismatched vocabularies, invalid
        sampling or control settings, a cache too short, or a memory plan
        that cannot fit.
    """
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    rows = prompt_rows(self._token_ids(prompts), self.target.vocab_size)
    models = (self.target,) + (() if self.drafter is None else
                               (self.drafter,))
    where, models = Placement.resolve(self.mesh, len(rows), *models)
    target, draft = models[0], models[1] if len(models) > 1 else None
    drafter = None if draft is None else self._drafter(target, draft)
    eos_id = self._eos_id()
    check_eos(eos_id, target.vocab_size)
    params = self._params(target.vocab_size, eos_id)
    if drafter is not None:
      check_tree(self.num_nodes, self._bound, self.gamma, drafter,
                 params.acceptance)
    tokens, lengths, cache_size = self._pad(rows, target.vocab_size,
                                            max_new_tokens, drafter)
    cap = output_cap(max_new_tokens, self.tokens_cap, cache_size)
    planned = dict(cache_size=cache_size, prompt_width=tokens.shape[1])
    if drafter is None:
      where.check_memory({"model": target}, chunk=1, **planned)
    else:
      where.check_memory({"target": target, "draft": draft},
                         chunk=(self.num_nodes or self._bound) + 1,
                         **planned)
    policy = None if drafter is None else resolve_policy(
        self.gamma, max_gamma=self.max_gamma, target=target,
        drafter=drafter, batch=len(rows), cache_size=cache_size,
        num_nodes=self.num_nodes)
    longest = int(np.max(lengths))
    tokens, lengths, budget = where.inputs(tokens, lengths, max_new_tokens)
    key, seed = _sampling_key(key)
    return Prepared(
        where=where, target=target, drafter=drafter,
        policy=policy, tokens=tokens, lengths=lengths, longest=longest,
        budget=budget, params=params, key=key, seed=seed,
        max_new_tokens=max_new_tokens, cache_size=cache_size, tokens_cap=cap)

  def run(self, call: Prepared, on_tokens: Any = None
          ) -> GenerateOutput | SpecOutput:
    """Stage 2: the compiled loop, one call, and its numpy outputs."""
    if call.drafts:
      return self._speculative(call, on_tokens)
    return self._plain(call, on_tokens)

  @property
  def _bound(self) -> int:
    """G, the most drafts a step may verify."""
    return gamma_bound(self.gamma, max_gamma=self.max_gamma)

  def _token_ids(self, prompts: Any) -> Any:
    """Text prompts encoded by the tokenizer; token ids as they are."""
    if isinstance(prompts, str):
      prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
      return prompts
    if self.tokenizer is None:
      if any(isinstance(p, str) for p in prompts):
        raise ValueError(
            "prompts are text, but the decoder has no tokenizer: pass "
            "SpeculativeDecoder(..., tokenizer=tok) (registry."
            "load_pretrained returns it with the model), or token ids.")
      return prompts
    return [self.tokenizer.encode(p) if isinstance(p, str) else p
            for p in prompts]

  def _drafter(self, target: LanguageModel, draft: Any) -> Drafter:
    """The placed draft as a `Drafter` that knows the target."""
    drafter = draft if isinstance(draft, Drafter) else DraftModel(draft)
    drafter = drafter.for_target(target, self.tokenizer)
    if drafter.vocab_size != target.vocab_size:
      raise ValueError(
          f"Draft and target vocabularies differ: draft has "
          f"{drafter.vocab_size} tokens, target has {target.vocab_size}. "
          "Speculative decoding needs one shared tokenizer.")
    return drafter

  def _eos_id(self) -> int | tuple[int, ...] | None:
    """The EOS ids: `eos_id`, else the tokenizer's; None for none."""
    eos = self.eos_id
    if eos is None and self.tokenizer is not None:
      eos = self.tokenizer.eos_ids
    if eos is None or isinstance(eos, (int, np.integer)):
      return None if eos is None else int(eos)
    return tuple(int(i) for i in eos) or None

  def _params(self, vocab_size: int, eos_id: Any) -> StepParams:
    """The sampler, controls, EOS ids and stop strings, validated."""
    controls, stops = controls_lib.resolve(
        vocab_size, tokenizer=self.tokenizer, eos_id=eos_id,
        **self.sampling.controls())
    s = self.sampling
    return StepParams.create(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        eos_id=eos_id, draft_stop_threshold=self.draft_stop_threshold,
        acceptance=acceptance_lib.from_name(self.acceptance), min_p=s.min_p,
        controls=controls, stops=stops)

  def _pad(self, rows: list[np.ndarray], vocab_size: int,
           max_new_tokens: int, drafter: Drafter | None
           ) -> tuple[np.ndarray, np.ndarray, int]:
    """Prompts [B, P], lengths [B] and S, with room for what a step may
    write past N (γ + 1 or T + 1, and a cascade's inner levels)."""
    if self.tokens_cap is not None:  # validated before it sizes the cache
      output_cap(max_new_tokens, self.tokens_cap, 0)
    reserve, note = 1, ""
    if drafter is not None:
      extra = drafter.extra_positions
      reserve = (self.num_nodes or self._bound) + 1 + extra
      note = (f" (gamma + 1, and {extra} for the drafter's inner levels: "
              "a Cascade's inner gamma + 1)" if extra else
              " (num_nodes + 1)" if self.num_nodes else "")
    return prepare_prompts(
        rows, vocab_size, max_new_tokens=max_new_tokens,
        cache_size=self.cache_size, reserve=reserve,
        tokens_cap=self.tokens_cap, reserve_note=note)

  def _plain(self, call: Prepared, on_tokens: Any
             ) -> GenerateOutput | SpecOutput:
    """The autoregressive loop; with a drafter (a policy that could never
    draft), a `SpecOutput` of plain steps."""
    with streaming.open_stream(on_tokens) as stream_id:
      out, counts = compilation.call(
          generate_loop, "generate",
          f"B={call.tokens.shape[0]}, S={call.cache_size}, "
          f"N_cap={call.tokens_cap}", call.target, call.tokens,
          call.lengths, call.params.sampling, call.params.eos_ids, call.key,
          call.budget, call.params.stops, stream_id,
          tokens_cap=call.tokens_cap, cache_size=call.cache_size,
          pad_id=self.pad_id)
    out, counts = call.where.rows((out, counts))
    base = GenerateOutput(
        tokens=out[:, :call.max_new_tokens], lengths=counts,
        finish_reason=finish_reasons(out, counts, call.params.eos_ids,
                                     call.params.stops),
        stop=tuple(self.sampling.stop or ()), seed=call.seed)
    if call.policy is None:
      return base
    # No acceptance could make drafting pay at this B on this machine: the
    # call ran plain steps, with no draft prefill or loop overhead.
    gamma = call.policy.max_gamma
    return SpecOutput(
        **vars(base), gamma=int(gamma), policy=policy_name(call.policy),
        stats=SpecStats.autoregressive(counts, gamma,
                                       max(call.tokens_cap - 1, 1),
                                       call.drafter.components),
        synthetic=call.params.acceptance.synthetic,
        policy_state=jax.device_get(call.policy.init(call.where.batch)))

  def _speculative(self, call: Prepared, on_tokens: Any) -> SpecOutput:
    """The speculative loop."""
    policy, gamma = call.policy, call.policy.max_gamma
    nodes = f", num_nodes={self.num_nodes}" if self.num_nodes else ""
    with streaming.open_stream(on_tokens) as stream_id:
      out, counts, stats, policy_state = compilation.call(
          speculative_loop, "speculative_generate",
          f"B={call.tokens.shape[0]}, S={call.cache_size}, "
          f"N_cap={call.tokens_cap}, gamma={gamma}"
          f"{policy_name(policy, ' ')}{nodes}", call.target, call.drafter,
          call.tokens, call.lengths, call.params, call.key, call.budget,
          policy, stream_id, tokens_cap=call.tokens_cap,
          cache_size=call.cache_size, pad_id=self.pad_id,
          num_nodes=self.num_nodes)
    where = call.where
    out, counts, policy_state = where.rows((out, counts, policy_state))
    stats = stats.replace(**where.rows(
        dict(accepted=stats.accepted, proposed=stats.proposed,
             scored=stats.scored)))
    return SpecOutput(
        tokens=out[:, :call.max_new_tokens], lengths=counts,
        finish_reason=finish_reasons(out, counts, call.params.eos_ids,
                                     call.params.stops),
        lossless=call.params.acceptance.lossless,
        stop=tuple(self.sampling.stop or ()), seed=call.seed,
        stats=where.totals(stats), gamma=int(gamma),
        synthetic=call.params.acceptance.synthetic,
        policy=policy_name(policy), policy_state=policy_state)
