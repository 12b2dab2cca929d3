"""Public decoding API: `generate` and `speculative_generate`.

Shape letters (`specjax.shapes`): B batch, P padded prompt (`prompt_bucket`), S
cache size, N max new tokens, G = γ.

Both take prompts as a list of token-id lists of different lengths and return
`tokens` [B, N] (generated ids only, `pad_id` after each row's end) and
`lengths` [B]. Each generation is one compiled call: prefill, then a
`lax.while_loop` that runs until every row hit EOS or N tokens.

Compile once per shape. A program is fixed by B, γ, the models (their
configs and matmul plans), and two coarse caps:

- the prompt buffer P: the longest prompt rounded up to a power of two
  (16, 32, 64, 128, ...). `specjax.models.Model.prefill` runs a long prompt
  in chunks of 64 tokens, so its compute follows the real length, not P;
- the output buffer N_cap: `max_new_tokens` rounded up to a power of two,
  at least 64. N itself is traced.

The default cache size S is a function of those two caps (P + N_cap + γ + 1,
rounded up to 128), so prompts of 5 to 600 tokens and any N <= 64 compile at
most 7 programs per (B, γ) (`tests/test_compile.py` checks the bound). A
cache_size passed by the user is a shape too. Temperature, top-k, top-p,
EOS ids, seeds, N and the draft stop threshold are traced, so changing them
never recompiles. Every compilation is logged on the "specjax" logger with
its time (`specjax.compilation`); JAX's persistent compilation cache is on
by default (`$SPECJAX_CACHE/xla_cache`; `SPECJAX_NO_COMPILE_CACHE=1` opts
out), so a second process reuses the programs, and `warmup` compiles ahead
of time.

Models are anything implementing `specjax.models.LanguageModel` (a
`specjax.models.Model`, or an adapter around another Flax model); the draft may
also be any `specjax.drafters.Drafter`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import adaptive
from specjax import buffers
from specjax import compilation
from specjax import rejection
from specjax import sampling
from specjax import speculate
from specjax.drafters import components
from specjax.drafters import DraftModel
from specjax.drafters import extra_positions
from specjax.drafters.base import init_and_guess
from specjax.drafters import Drafter
from specjax.models import LanguageModel
from specjax.models import model_output
from specjax.sharding.batch import Placement
from specjax.speculate import SpecState
from specjax.speculate import SpecStats
from specjax.speculate import StepParams

__all__ = [
    "GenerateOutput", "SpecOutput", "SpecStats", "StepParams",
    "default_cache_size", "first_acceptance", "generate",
    "gamma_bound", "init_spec_state", "max_new_tokens_cap",
    "prepare_prompts", "prompt_bucket", "resolve_gamma",
    "speculative_generate", "synthetic_text", "warmup",
]

_MIN_BUCKET = 16
_MIN_TOKENS_CAP = 64
_CACHE_ALIGN = 128

compilation.enable_persistent_cache()


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """Result of `generate`.

  Attributes:
    tokens: [B, N] int32 generated ids, `pad_id` after each row's end.
    lengths: [B] int32 generated tokens per row (an EOS is counted and kept).
  """

  tokens: np.ndarray
  lengths: np.ndarray

  def row(self, b: int) -> list[int]:
    """The tokens generated for row b, without padding."""
    return self.tokens[b, :self.lengths[b]].tolist()


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
    policy_state: the adaptive policy's final `adaptive.PolicyState`
      (numpy; None for a fixed γ): `policy.warm(policy_state)` carries
      what it learned into the next call.
  """

  stats: SpecStats = None
  gamma: int = 0
  synthetic: bool = False
  policy: str = ""
  policy_state: Any = None


@flax.struct.dataclass(kw_only=True)
class _ARState:
  """The autoregressive loop's state.

  Attributes:
    tokens: [B, N_cap + 1] int32 generated tokens.
    num_generated: [B] int32 tokens generated per row.
    done: [B] bool rows that stopped.
    last_token: [B] int32 newest token, not yet in the cache.
    cache: the model's cache.
    key: PRNG key.
  """

  tokens: jax.Array
  num_generated: jax.Array
  done: jax.Array
  last_token: jax.Array
  cache: Any
  key: jax.Array


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def prompt_bucket(longest: int, cache_size: int | None = None) -> int:
  """P, the padded prompt width for a longest prompt of `longest` tokens.

  Powers of two from 16: few shapes to compile. Padding costs no compute
  for long prompts, which `Model.prefill` runs in 64-token chunks up to the
  longest real prompt.
  """
  bucket = max(_MIN_BUCKET, _pow2(longest))
  return bucket if cache_size is None else min(bucket, cache_size)


def max_new_tokens_cap(max_new_tokens: int) -> int:
  """N_cap, the static output width: N rounded up to a power of two >= 64."""
  return max(_MIN_TOKENS_CAP, _pow2(max_new_tokens))


def default_cache_size(longest: int, max_new_tokens: int, reserve: int = 1,
                       tokens_cap: int | None = None) -> int:
  """S when none is given: P + N_cap + `reserve`, rounded up to 128.

  A function of the caps only (`prompt_bucket`, `max_new_tokens_cap`), so it
  fixes no shape of its own.
  """
  fit = (prompt_bucket(longest) + _tokens_cap(max_new_tokens, tokens_cap)
         + reserve)
  return -(-fit // _CACHE_ALIGN) * _CACHE_ALIGN


def prepare_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, *,
                    max_new_tokens: int, cache_size: int | None,
                    reserve: int = 1, tokens_cap: int | None = None,
                    reserve_note: str = ""
                    ) -> tuple[np.ndarray, np.ndarray, int]:
  """Validates prompts and pads them to a bucket.

  Args:
    prompts: B lists of token ids.
    vocab_size: V; every id must be in [0, V).
    max_new_tokens: N.
    cache_size: S, or None for `default_cache_size`.
    reserve: extra positions the loop may write past the N tokens (γ + 1 for
      speculative decoding).
    tokens_cap: N_cap (default `max_new_tokens_cap(N)`).
    reserve_note: what the reserve is made of, for the error message.

  Returns:
    tokens [B, P] int32 right-padded with 0, lengths [B] int32, and S.

  Raises:
    ValueError: on an empty batch or prompt, an out-of-range id, or a cache
      too small for the longest prompt plus N plus `reserve`.
  """
  if isinstance(prompts, (str, bytes)) or not len(prompts):
    raise ValueError("prompts must be a non-empty list of token-id lists.")
  rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
  for b, row in enumerate(rows):
    if row.size == 0:
      raise ValueError(f"Prompt {b} is empty; every prompt needs at least "
                       "one token (e.g. a BOS id).")
    if row.min() < 0 or row.max() >= vocab_size:
      raise ValueError(f"Prompt {b} has token ids outside [0, {vocab_size}).")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  lengths = np.array([r.size for r in rows], np.int32)
  longest = int(lengths.max())
  needed = longest + max_new_tokens + reserve
  if cache_size is None:
    cache_size = default_cache_size(longest, max_new_tokens, reserve,
                                    tokens_cap)
  elif needed > cache_size:
    raise ValueError(
        f"The cache is too short: the longest prompt has {longest} tokens, "
        f"plus max_new_tokens={max_new_tokens} plus {reserve} positions of "
        f"slack{reserve_note} needs {needed} positions, but "
        f"cache_size={cache_size}.")
  bucket = prompt_bucket(longest, cache_size)
  tokens = np.zeros((len(rows), bucket), np.int32)
  for b, row in enumerate(rows):
    tokens[b, :row.size] = row
  return tokens, lengths, cache_size


def _tokens_cap(max_new_tokens: int, tokens_cap: int | None) -> int:
  if tokens_cap is None:
    return max_new_tokens_cap(max_new_tokens)
  if tokens_cap < max_new_tokens:
    raise ValueError(f"tokens_cap={tokens_cap} is below max_new_tokens="
                     f"{max_new_tokens}.")
  return tokens_cap


def _key(key: jax.Array | int | None) -> jax.Array:
  if key is None:
    return jax.random.key(0)
  if isinstance(key, int):
    return jax.random.key(key)
  return key


def _start(target: LanguageModel, prompts: jax.Array, lengths: jax.Array,
           params: sampling.SamplingParams, eos_ids: jax.Array, key: jax.Array,
           *, cache_size: int, width: int, max_new_tokens: int,
           return_hidden: bool = False):
  """Prefills the target, samples and emits the first token.

  Returns:
    first [B] token, the distribution [B, V] it was drawn from, the
    target's cache, the output buffer [B, width], counts [B], done [B],
    and the key left for the loop; with `return_hidden`, also the target's
    hidden states [B, P, E] over the prompts.
  """
  key, first_key = jax.random.split(key)
  cache = target.init_cache(prompts.shape[0], cache_size)
  hidden = ()
  if return_hidden:
    logits, cache, hidden = target.prefill(prompts, lengths, cache,
                                           return_hidden=True)
    hidden = (hidden,)
  else:
    logits, cache = target.prefill(prompts, lengths, cache)  # [B, V]
  probs = sampling.probabilities(logits, params)  # [B, V]
  first = sampling.sample(first_key, probs)
  batch = first.shape[0]
  tokens, counts, done = buffers.emit(
      jnp.zeros((batch, width), jnp.int32), jnp.zeros((batch,), jnp.int32),
      jnp.zeros((batch,), bool), first[:, None], jnp.ones((batch,), jnp.int32),
      eos_ids, max_new_tokens)
  return (first, probs, cache, tokens, counts, done, key) + hidden


@functools.partial(jax.jit, static_argnames=("tokens_cap", "cache_size",
                                             "pad_id"))
def _generate(model, prompts, lengths, params, eos_ids, key, max_new_tokens,
              *, tokens_cap, cache_size, pad_id):
  first, _, cache, tokens, counts, done, key = _start(
      model, prompts, lengths, params, eos_ids, key, cache_size=cache_size,
      width=tokens_cap + 1, max_new_tokens=max_new_tokens)
  state = _ARState(tokens=tokens, num_generated=counts, done=done,
                   last_token=first,
                   cache=cache, key=key)

  def step(s: _ARState) -> _ARState:
    key, sample_key = jax.random.split(s.key)
    start = s.cache.lengths
    out, cache = model(s.last_token[:, None], s.cache)  # [B, 1] -> [B, 1, V]
    logits = model_output(out).logits[:, 0]
    token = sampling.sample(
        sample_key, sampling.probabilities(logits, params))  # [B]
    # Done rows do not advance, so they never run past the cache.
    cache = cache.rollback(jnp.where(s.done, start, cache.lengths))
    tokens, counts, done = buffers.emit(
        s.tokens, s.num_generated, s.done, token[:, None],
        jnp.ones_like(s.num_generated), eos_ids, max_new_tokens)
    return s.replace(tokens=tokens, num_generated=counts, done=done,
                     last_token=token, cache=cache, key=key)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
  return (buffers.finalize(state.tokens, state.num_generated, tokens_cap,
                           pad_id), state.num_generated)


def generate(model: LanguageModel, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | Sequence[int] | None = None,
             key: jax.Array | int | None = None,
             cache_size: int | None = None,
             pad_id: int = 0,
             tokens_cap: int | None = None,
             mesh: jax.sharding.Mesh | None = None) -> GenerateOutput:
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
    cache_size: S; default P + N_cap + 1 rounded up to 128 (module doc).
    pad_id: written after each row's end.
    tokens_cap: N_cap, the static output width (>= N); default
      `max_new_tokens_cap(N)`.
    mesh: run over this `specjax.sharding.make_mesh` mesh (the model is
      placed on it if it is not yet; default: the mesh the model was
      placed on by `specjax.sharding.shard`, or one device). B need not
      divide the data axis (`specjax.sharding.batch`).

  Returns:
    `GenerateOutput` with tokens [B, N] and lengths [B].
  """
  params = sampling.SamplingParams.create(temperature, top_k, top_p)
  cap = _tokens_cap(max_new_tokens, tokens_cap)
  tokens, lengths, cache_size = prepare_prompts(
      prompts, model.vocab_size, max_new_tokens=max_new_tokens,
      cache_size=cache_size, reserve=1, tokens_cap=cap)
  where, (model,) = Placement.resolve(mesh, len(tokens), model)
  where.check_memory({"model": model}, cache_size=cache_size, chunk=1)
  tokens, lengths, budget = where.inputs(tokens, lengths, max_new_tokens)
  out, counts = compilation.call(
      _generate, "generate",
      f"B={tokens.shape[0]}, P={tokens.shape[1]}, S={cache_size}, "
      f"N<={cap}", model, tokens, lengths, params,
      buffers.eos_array(eos_id), _key(key), budget,
      tokens_cap=cap, cache_size=cache_size, pad_id=pad_id)
  out, counts = where.rows((out, counts))
  return GenerateOutput(tokens=out[:, :max_new_tokens], lengths=counts)


def init_spec_state(target: LanguageModel, drafter: Drafter,
                    prompts: jax.Array, lengths: jax.Array,
                    params: StepParams, key: jax.Array, *, gamma: int,
                    max_new_tokens: int | jax.Array, cache_size: int,
                    tokens_cap: int | None = None,
                    policy: adaptive.GammaPolicy | None = None,
                    synthetic: bool = False) -> SpecState:
  """Prefills target and drafter and emits the target's first token.

  Where the drafter's prefill guesses the first token too (`init_guess`),
  the policy observes how likely that guess was to be accepted
  (`first_acceptance`) before any step drafts.

  Args:
    target: the verifying `LanguageModel`.
    drafter: a `Drafter` (e.g. `DraftModel(draft)`).
    prompts: [B, P] int32 right-padded prompts (`prepare_prompts`).
    lengths: [B] int32 prompt lengths.
    params: traced settings (`StepParams.create`).
    key: PRNG key.
    gamma: G.
    max_new_tokens: N (an int or a traced [] int32).
    cache_size: S.
    tokens_cap: N_cap, the static output width (default N, which must then
      be an int).
    policy: an adaptive γ policy (G is then its γ_max), or None.
    synthetic: acceptance is synthetic (`params.synthetic`).

  Returns:
    The `SpecState` that `speculate.speculate_step` advances.
  """
  cap = max_new_tokens if tokens_cap is None else tokens_cap
  # A drafter reading the target's features (EAGLE) gets the prompt's.
  features = getattr(drafter, "uses_prompt_hidden", False)
  first, probs, target_cache, tokens, counts, done, key, *hidden = _start(
      target, prompts, lengths, params.sampling, params.eos_ids, key,
      cache_size=cache_size, width=cap + gamma + 1,
      max_new_tokens=max_new_tokens, return_hidden=features)
  extra = {"prompt_hidden": hidden[0]} if features else {}
  drafter_state, guess = init_and_guess(drafter, prompts, lengths, first,
                                        cache_size, **extra)
  policy_state = None
  if policy is not None:
    policy_state = policy.init(prompts.shape[0])
    if guess is not None:
      policy_state = policy.observe(
          policy_state, first_acceptance(probs, guess, params, lengths,
                                         synthetic),
          ~done)
  return SpecState(
      tokens=tokens, num_generated=counts, done=done, last_token=first,
      target_cache=target_cache, drafter_state=drafter_state, key=key,
      stats=SpecStats.zeros(prompts.shape[0], gamma, max(cap - 1, 1),
                            components(drafter)),
      policy_state=policy_state)


def synthetic_text(key: jax.Array | int | None) -> jax.Array:
  """The PRNG key of the synthetic text (`rejection.Synthetic`) that a
  generation with `key` decodes: every policy, γ and drafter run with one
  key meets the same verdicts at each sequence position."""
  return jax.random.fold_in(_key(key), 2)


def first_acceptance(probs: jax.Array, guess: jax.Array, params: StepParams,
                     positions: jax.Array, synthetic: bool) -> jax.Array:
  """[B] float32 how likely a first draft from the drafter's `guess`
  logits [B, V] was to be accepted against the target's first-token
  distribution `probs` [B, V] (`rejection.acceptance_probability`, 0 or 1
  under greedy decoding); with synthetic acceptance, the verdict of
  `params.synthetic`'s text on the first token's sequence position
  (`positions` [B], the prompts' lengths), as a verified draft there
  would get."""
  if synthetic:
    return params.synthetic.accepts(positions[:, None])[:, 0].astype(
        jnp.float32)
  return rejection.acceptance_probability(
      probs, sampling.probabilities(guess, params.sampling))


@functools.partial(jax.jit, static_argnames=(
    "gamma", "tokens_cap", "cache_size", "pad_id", "synthetic", "num_nodes"))
def _speculative_generate(target, drafter, prompts, lengths, params, key,
                          max_new_tokens, policy, *, gamma, tokens_cap,
                          cache_size, pad_id, synthetic, num_nodes):
  if synthetic:
    params = params.with_text(synthetic_text(key))
  state = init_spec_state(target, drafter, prompts, lengths, params, key,
                          gamma=gamma, max_new_tokens=max_new_tokens,
                          cache_size=cache_size, tokens_cap=tokens_cap,
                          policy=policy, synthetic=synthetic)
  step = functools.partial(
      speculate.speculate_step, target=target, drafter=drafter, params=params,
      gamma=gamma, max_new_tokens=max_new_tokens, synthetic=synthetic,
      policy=policy, num_nodes=num_nodes)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
  tokens = buffers.finalize(state.tokens, state.num_generated, tokens_cap,
                            pad_id)
  return tokens, state.num_generated, state.stats, state.policy_state


def gamma_bound(gamma: int | str | adaptive.GammaPolicy, *,
                max_gamma: int) -> int:
  """G, the most drafts a step may verify, for a `gamma` argument of
  `speculative_generate` (validated)."""
  if isinstance(gamma, adaptive.GammaPolicy):
    return gamma.max_gamma
  if isinstance(gamma, str):
    if gamma in ("auto", "heuristic"):
      return max_gamma
  elif not isinstance(gamma, bool) and int(gamma) == gamma and gamma >= 1:
    return int(gamma)
  raise ValueError(f"gamma must be an integer >= 1, 'auto' or "
                   f"'heuristic', got {gamma!r}.")


def resolve_gamma(gamma: int | str | adaptive.GammaPolicy, *,
                  max_gamma: int, target: LanguageModel, drafter: Drafter,
                  batch: int, cache_size: int = 512
                  ) -> tuple[int, adaptive.GammaPolicy | None]:
  """G and the policy for a `gamma` argument of `speculative_generate`.

  An int is a fixed γ (no policy); "heuristic" is `adaptive.Heuristic`
  and "auto" `adaptive.Auto` with costs measured on this machine at B =
  `batch` and S = `cache_size` (cached on disk), both with γ_max =
  `max_gamma`; a `GammaPolicy` is used as is.
  """
  bound = gamma_bound(gamma, max_gamma=max_gamma)
  if gamma == "heuristic":
    return bound, adaptive.Heuristic(max_gamma)
  if gamma == "auto":
    return bound, adaptive.Auto.measure(target, drafter, batch=batch,
                                        max_gamma=max_gamma,
                                        cache_size=cache_size)
  return bound, gamma if isinstance(gamma, adaptive.GammaPolicy) else None


def speculative_generate(
    target: LanguageModel, draft: LanguageModel | Drafter,
    prompts: Sequence[Sequence[int]], *,
    gamma: int | str | adaptive.GammaPolicy, max_new_tokens: int,
    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    key: jax.Array | int | None = None, cache_size: int | None = None,
    pad_id: int = 0, draft_stop_threshold: float = 0.0,
    synthetic_acceptance: float | None = None,
    tokens_cap: int | None = None, max_gamma: int = 8,
    num_nodes: int | None = None,
    mesh: jax.sharding.Mesh | None = None) -> SpecOutput:
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
      `max_gamma`), or a `specjax.adaptive.GammaPolicy`. Any policy keeps
      the output exact; see `specjax.adaptive`. A policy that could never
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

  Returns:
    `SpecOutput` with tokens [B, N], lengths [B] and statistics.
  """
  where, (target, draft) = Placement.resolve(mesh, len(prompts), target,
                                             draft)
  drafter = draft if hasattr(draft, "propose") else DraftModel(draft)
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(
        f"Draft and target vocabularies differ: draft has "
        f"{drafter.vocab_size} tokens, target has {target.vocab_size}. "
        "Speculative decoding needs one shared tokenizer.")
  bound = gamma_bound(gamma, max_gamma=max_gamma)
  _check_tree(num_nodes, bound, gamma, drafter)
  params = StepParams.create(
      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
      draft_stop_threshold=draft_stop_threshold,
      synthetic_acceptance=synthetic_acceptance)
  synthetic = synthetic_acceptance is not None
  extra = extra_positions(drafter)
  cap = _tokens_cap(max_new_tokens, tokens_cap)
  tokens, lengths, cache_size = prepare_prompts(
      prompts, target.vocab_size, max_new_tokens=max_new_tokens,
      cache_size=cache_size, reserve=(num_nodes or bound) + 1 + extra,
      tokens_cap=cap,
      reserve_note=f" (gamma + 1, and {extra} for the drafter's inner "
      "levels: a Cascade's inner gamma + 1)" if extra else (
          " (num_nodes + 1)" if num_nodes else ""))
  where.check_memory({"target": target, "draft": draft},
                     cache_size=cache_size, chunk=(num_nodes or bound) + 1)
  gamma, policy = resolve_gamma(gamma, max_gamma=max_gamma, target=target,
                                drafter=drafter, batch=len(prompts),
                                cache_size=cache_size)
  if policy is not None and not policy.may_draft():
    # No acceptance could make drafting pay at this B on this machine: the
    # fallback is `generate` itself, with no draft prefill or loop overhead.
    base = generate(target, prompts, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p,
                    eos_id=eos_id, key=key, cache_size=cache_size,
                    pad_id=pad_id, tokens_cap=cap)
    return SpecOutput(
        tokens=base.tokens, lengths=base.lengths, stats=(
            SpecStats.autoregressive(base.lengths, gamma, max(cap - 1, 1),
                                     components(drafter))),
        gamma=int(gamma), synthetic=synthetic, policy=_policy_name(policy),
        policy_state=jax.device_get(policy.init(len(prompts))))
  tokens, lengths, budget = where.inputs(tokens, lengths, max_new_tokens)
  out, counts, stats, policy_state = compilation.call(
      _speculative_generate, "speculative_generate",
      f"B={tokens.shape[0]}, P={tokens.shape[1]}, S={cache_size}, "
      f"N<={cap}, gamma={gamma}{_policy_name(policy, ' ')}"
      f"{f', num_nodes={num_nodes}' if num_nodes else ''}", target, drafter,
      tokens, lengths, params, _key(key), budget, policy, gamma=int(gamma),
      tokens_cap=cap, cache_size=cache_size, pad_id=pad_id,
      synthetic=synthetic, num_nodes=num_nodes)
  out, counts, policy_state = where.rows((out, counts, policy_state))
  stats = stats.replace(**where.rows(
      {f: getattr(stats, f) for f in ("accepted", "proposed", "scored")}))
  return SpecOutput(tokens=out[:, :max_new_tokens], lengths=counts,
                    stats=where.totals(stats), gamma=int(gamma),
                    synthetic=synthetic, policy=_policy_name(policy),
                    policy_state=policy_state)


def _check_tree(num_nodes: int | None, gamma: int,
                requested: int | str | adaptive.GammaPolicy,
                drafter: Drafter) -> None:
  """Errors for `num_nodes` with G = `gamma` and the `gamma` argument as
  `requested` (an int, or an adaptive policy or its name)."""
  if num_nodes is None:
    return
  if isinstance(num_nodes, bool) or int(num_nodes) != num_nodes or (
      num_nodes < gamma):
    raise ValueError(f"num_nodes must be an integer >= gamma={gamma} (one "
                     f"node per depth at least), got {num_nodes!r}.")
  if isinstance(requested, (str, adaptive.GammaPolicy)):
    name = (requested if isinstance(requested, str)
            else _policy_name(requested))
    raise ValueError("num_nodes (token trees) takes a fixed integer gamma, "
                     f"not an adaptive policy ({name}).")
  if not getattr(drafter, "supports_trees", False):
    raise ValueError(f"{type(drafter).__name__} drafts chains only; token "
                     "trees (num_nodes) need a tree drafter: DraftModel or "
                     "PromptLookup.")


def _policy_name(policy: adaptive.GammaPolicy | None, prefix: str = ""
                 ) -> str:
  return "" if policy is None else prefix + type(policy).__name__.lower()


def warmup(target: LanguageModel, draft: LanguageModel | Drafter | None = None,
           *, batch: int, prompt_len: int, max_new_tokens: int,
           gamma: int | None = None, cache_size: int | None = None,
           eos_id: int | Sequence[int] | None = None) -> int:
  """Compiles ahead of time what later calls with these shapes will run.

  Runs `generate` (and `speculative_generate` when `draft` and `gamma` are
  given) once on dummy prompts of `prompt_len` tokens with one new token:
  N is traced under the same N_cap, so the program is the one a call with
  `max_new_tokens` uses, and the run itself is one prefill and one step.
  With the persistent compilation cache on, later processes reuse it too.

  Returns:
    The number of programs compiled.
  """
  before = compilation.num_compiled()
  prompts = [[0] * prompt_len] * batch
  # cache_size None sizes each call's cache exactly as a real call would.
  kwargs = dict(max_new_tokens=1, cache_size=cache_size, eos_id=eos_id,
                tokens_cap=max_new_tokens_cap(max_new_tokens))
  generate(target, prompts, **kwargs)
  if draft is not None and gamma is not None:
    speculative_generate(target, draft, prompts, gamma=gamma, **kwargs)
  return compilation.num_compiled() - before
