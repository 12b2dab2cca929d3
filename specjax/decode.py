"""Public decoding API: `generate` and `speculative_generate`.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, N
max new tokens, G = γ.

Both take prompts as a list of token-id lists of different lengths and return
`tokens` [B, N] (generated ids only, `pad_id` after each row's end) and
`lengths` [B]. Each is a `specjax.decoder.SpeculativeDecoder` built for one
call, with the keywords of earlier releases: the decoder object holds the
models, tokenizer and settings once, takes text in and gives text out, and
its EOS ids default to the tokenizer's. These two keep their defaults: no
EOS unless `eos_id` is given, and seed 0 unless `key` is.

Each generation is one compiled call (`specjax.loops`): prefill, then a
`lax.while_loop` that runs until every row hit EOS or N tokens.

Compile once per cache class: a program is fixed by B, γ, the models and
the cache size S, whose default is a power of two holding the longest
prompt + N + γ + 1 (at least 256 for up to 64 rows); the prompt buffer
and the output buffer are derived from S (`specjax.padding`), and the
prompt's length and N are traced. Prompts of 5 to 600 tokens with N <=
100 compile three programs per (B, γ), and a call compiles nothing else:
inputs travel as numpy arrays
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

from typing import Any, Sequence

import jax

from specjax import acceptance as acceptance_lib
from specjax import compilation
from specjax import policies
from specjax.arguments import check_model
from specjax.arguments import resolve_policy
from specjax.decoder import SamplingConfig
from specjax.decoder import SpeculativeDecoder
from specjax.drafters import DraftModel
from specjax.drafters import Drafter
from specjax.loops import synthetic_text
from specjax.models import LanguageModel
from specjax.outputs import GenerateOutput
from specjax.outputs import SpecOutput
from specjax.padding import cache_class
from specjax.padding import default_cache_size
from specjax.padding import prepare_prompts
from specjax.padding import prompt_bucket
from specjax.step_types import SpecStats
from specjax.step_types import StepParams

__all__ = [
    "GenerateOutput", "SamplingConfig", "SpecOutput", "SpecStats",
    "SpeculativeDecoder", "StepParams", "cache_class", "default_cache_size",
    "generate", "prepare_prompts", "prompt_bucket", "resolve_policy",
    "speculative_generate", "synthetic_text", "warmup",
]


def generate(model: LanguageModel, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, eos_id: int | Sequence[int] | None = None,
             key: jax.Array | int | None = None,
             cache_size: int | None = None, pad_id: int = 0,
             tokens_cap: int | None = None,
             mesh: jax.sharding.Mesh | None = None, on_tokens: Any = None,
             tokenizer: Any = None, **sampling: Any) -> GenerateOutput:
  """Batched autoregressive decoding, compiled as one call.

  `SpeculativeDecoder(model, ...).generate(prompts, ...)` for one call.

  Args:
    model: a `LanguageModel` (e.g. `specjax.models.Model`).
    prompts: B lists of token ids, of any lengths >= 1.
    max_new_tokens: N, the most tokens generated per row (an int >= 1).
    eos_id: one id or several; a row stops after emitting one (default
      none: every row runs to N).
    key: PRNG key or int seed (default seed 0: the same samples on every
      call; pass another to vary them).
    cache_size: S; default the class of the longest prompt + N + 1 (a
      power of two, >= 256 for up to 64 rows; `specjax.padding`). It fixes
      the program.
    pad_id: written after each row's end.
    tokens_cap: N_cap, the static output width (>= N); default S.
    mesh: run over this `specjax.sharding.make_mesh` mesh (the model is
      placed on it if it is not yet; default: the mesh the model was
      placed on by `specjax.sharding.shard`, or one device). B need not
      divide the data axis (`specjax.sharding.batch`).
    on_tokens: a callback given, after the prefill and after every step,
      each row's newly committed token ids (B lists; `specjax.streaming`;
      `streaming.TextStream` decodes them).
    tokenizer: the model's `specjax.tokenizer.Tokenizer`, for `stop`,
      `regex` and `json_schema`.
    **sampling: the fields of `specjax.decoder.SamplingConfig`:
      `temperature` (0, greedy, by default), `top_k`, `top_p`, `min_p`,
      and the generation controls `stop`, `repetition_penalty`,
      `presence_penalty`, `frequency_penalty`, `logit_bias`, `regex`,
      `json_schema` (each None is off and costs nothing; any value is
      traced, so changing it never recompiles; `specjax.controls`).

  Returns:
    `GenerateOutput` with tokens [B, N], lengths [B] and finish reasons.
  """
  check_model(model, "model")
  decoder = SpeculativeDecoder(
      model, tokenizer=tokenizer, eos_id=() if eos_id is None else eos_id,
      sampling=SamplingConfig.from_keywords("generate", **sampling),
      cache_size=cache_size, tokens_cap=tokens_cap, pad_id=pad_id,
      mesh=mesh)
  return _one_call(decoder, prompts, max_new_tokens, key, on_tokens)


def speculative_generate(
    target: LanguageModel, draft: LanguageModel | Drafter,
    prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
    gamma: int | str | policies.GammaPolicy, eos_id: Any = None,
    key: jax.Array | int | None = None, cache_size: int | None = None,
    pad_id: int = 0, draft_stop_threshold: float = 0.0,
    synthetic_acceptance: float | None = None,
    tokens_cap: int | None = None, max_gamma: int = 8,
    num_nodes: int | None = None, mesh: jax.sharding.Mesh | None = None,
    on_tokens: Any = None, tokenizer: Any = None,
    acceptance: str | acceptance_lib.Acceptance = "exact",
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3, acceptance_threshold: float = 0.5,
    **sampling: Any) -> SpecOutput:
  """Speculative decoding, compiled as one call.

  `SpeculativeDecoder(target, drafter=draft, ...).generate(...)` for one
  call. The output is distributed exactly as `generate(target, ...)`'s;
  greedy, it equals it token for token (up to floating-point near-ties).

  Args:
    target: the `LanguageModel` whose distribution is sampled.
    draft: a smaller `LanguageModel` with the same vocabulary, or any
      `Drafter`.
    prompts: B lists of token ids, of any lengths >= 1.
    gamma: γ >= 1 draft tokens per step, "auto", "heuristic" or a
      `specjax.policies.GammaPolicy` (`SpeculativeDecoder.gamma`); a
      policy that could never draft at these costs runs `generate`.
    max_new_tokens: N.
    eos_id, key, on_tokens, **sampling: as in `generate` (no EOS and seed
      0 by default); every control keeps the output exact.
    draft_stop_threshold, max_gamma, num_nodes, cache_size, tokens_cap,
      pad_id, mesh, tokenizer: the `SpeculativeDecoder` attributes.
    acceptance: "exact", a lossy rule labelled `lossless=False` ("typical"
      with `typical_epsilon` ε and `typical_delta` δ, "relaxed" with λ =
      `acceptance_threshold`), or any `specjax.acceptance.Acceptance`.
    synthetic_acceptance: keep each draft with this fixed probability
      instead of verifying it (`acceptance.Synthetic`: timing random
      weights only; the output is NOT the target's distribution).

  Returns:
    `SpecOutput`: tokens [B, N], lengths [B], finish reasons, statistics.
  """
  check_model(target, "target")
  check_model(draft, "draft", drafter_too=True)
  acceptance = acceptance_lib.from_name(
      acceptance, synthetic_acceptance=synthetic_acceptance,
      typical_epsilon=typical_epsilon, typical_delta=typical_delta,
      acceptance_threshold=acceptance_threshold)
  decoder = SpeculativeDecoder(
      target, drafter=draft, gamma=gamma, tokenizer=tokenizer,
      eos_id=() if eos_id is None else eos_id,
      sampling=SamplingConfig.from_keywords("speculative_generate",
                                            **sampling),
      acceptance=acceptance, num_nodes=num_nodes, max_gamma=max_gamma,
      draft_stop_threshold=draft_stop_threshold, cache_size=cache_size,
      tokens_cap=tokens_cap, pad_id=pad_id, mesh=mesh)
  return _one_call(decoder, prompts, max_new_tokens, key, on_tokens)


def _one_call(decoder: SpeculativeDecoder, prompts: Any,
              max_new_tokens: int, key: jax.Array | int | None,
              on_tokens: Any) -> GenerateOutput:
  """`decoder.generate` without the text stage, seed 0 by default."""
  call = decoder.prepare(prompts, max_new_tokens=max_new_tokens,
                         key=0 if key is None else key)
  return decoder.run(call, on_tokens=on_tokens)


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
      prompt_len, max_new_tokens, reserve, batch=batch)
  generate(target, prompts, max_new_tokens=1, cache_size=size(1),
           eos_id=eos_id)
  if draft is not None and gamma is not None:
    drafter = draft if isinstance(draft, Drafter) else DraftModel(draft)
    speculative_generate(
        target, draft, prompts, gamma=gamma, max_new_tokens=1,
        cache_size=size(gamma + 1 + drafter.extra_positions), eos_id=eos_id)
  return compilation.num_compiled() - before
