"""What a speculative step costs, as a γ policy prices it.

Shape letters (`specjax.shapes`): B batch, S cache size, T tokens per
forward, G = γ_max, W verification widths.

A step that drafts k tokens costs the drafter's work, a first (two-token
catch-up) pass and k - 1 one-token forwards of its `cost_model`, plus one
target pass over the smallest compiled width that holds k + 1 tokens
(`specjax.verify.verify_widths`). `StepCosts` holds those forward times for
one call's B and S, from one of two sources, and nothing here times or
reads anything itself:

- a measured table, written by the explicit tuning step (`python -m
  specjax.tune`, or `specjax.tuning.cost.measure`) and read back by
  `specjax.policies.measured`;
- else a roofline: each forward costs the larger of its bytes read
  (weights, and the whole static KV cache that attention reads) over the
  memory bandwidth and its FLOPs over the peak rate, plus a fixed launch
  overhead (`Roofline`). A mixture of experts' pass of B·T token rows
  reads the union of the experts its rows choose
  (`CostGeometry.bytes_read`), so a longer draft costs its verification
  the experts it wakes; measured tables time passes of distinct tokens,
  which wake them as drafts do. The machine's bandwidth and peak come
  from the tuning step's measurement where it ran (`Roofline.cached`),
  else from nominal figures per backend and device (`Roofline.nominal`,
  `specjax.hardware.nominal_rates`).

So a user's first call and every later one cost what the steady state
costs: no forward is timed inside `speculative_generate`.

A speculative step costs the drafter's work plus one target pass over
γ+1 tokens, and emits the accepted drafts plus one token. Leviathan et al.
(2023) assume the pass costs one forward and every position is accepted
with the same α. Neither holds on real hardware: the (γ+1)-token pass
costs more than a forward, by an amount that depends on the machine and
the batch (BENCHMARKS.md), and acceptance falls with the draft position.
`StepCosts.tokens_per_s` therefore uses

    tokens/s = B · E[τ](γ) / (d(γ) + t_target(B, γ+1)),
    d(γ) = t_draft(B, 2) + (γ-1) · t_draft(B, 1),
    E[τ](γ) = 1 + Σ_{i=1..γ} Π_{j≤i} a_j,

with t per model, batch size and chunk length T (the tuning step's
table, or the roofline), and a_j the probability that
draft position j is accepted given that every earlier one was (the
per-position acceptance specjax reports). A draft model proposes γ
tokens with one two-token pass (it catches up on the last committed
token, and on the block's last draft when the whole block was accepted;
`drafters.track.catch_up`) and γ-1 one-token forwards (`drafting_ms`).
γ = 0 is a plain autoregressive step: B tokens per t_target(B, 1). A
drafter without a model (prompt lookup) has d = 0. With a constant a_j =
α, t_target(B, γ+1) = t_target(B, 1) and t_draft(B, 2) = t_draft(B, 1)
this is Leviathan's formula.

That is the steady state. One generation of B rows of N tokens each runs
until its slowest row ends, and rows that finish earlier idle through its
last steps, which at large B and small N costs much of the steady rate
(BENCHMARKS.md). `tokens_per_s(..., tokens=N)` therefore divides B · N by
the expected number of steps of the slowest row (`expected_steps`)
instead of by N / E[τ].
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import hardware
from specjax.models.decoder import prefill_passes
from specjax.models.protocol import declared
from specjax.models.protocol import LanguageModel
from specjax.policies import measured
from specjax.verify import verify_widths
from specjax.verify import width_index

__all__ = ["ForwardCosts", "Roofline", "StepCosts", "catch_up_ms",
           "drafting_ms", "expected_steps", "expected_tokens", "survival"]


def drafting_ms(num_drafts: jax.Array, first_draft_ms: jax.Array,
                draft_ms: jax.Array) -> jax.Array:
  """[...] predicted ms a draft model spends drafting `num_drafts` [...]
  tokens: its first (catch-up) pass, then a forward per further token; 0
  for none (`ForwardCosts.drafting_ms` on the host)."""
  return jnp.where(num_drafts > 0,
                   first_draft_ms + (num_drafts - 1) * draft_ms, 0.0)


def catch_up_ms(idle: jax.Array, draft_ms: jax.Array, target_ms: jax.Array,
                max_gamma: int) -> jax.Array:
  """[] predicted ms a draft model spends catching up on the `idle` tokens
  plain steps emitted without it: ⌈idle / (G+1)⌉ passes of G+1 tokens,
  each priced at its one-token forward (`draft_ms`) times the target's
  ratio t(G+1) / t(1) (`target_ms` [W])."""
  return (jnp.ceil(idle / (max_gamma + 1)) * draft_ms * target_ms[-1]
          / target_ms[0])


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
  """Mean ms of one forward of a model at batch B, by chunk length T.

  Attributes:
    batch: B.
    forward_ms: T -> ms, for the T measured (or modelled).
    source: "measured", "cache" or "roofline".
  """

  batch: int
  forward_ms: dict[int, float]
  source: str = "measured"

  def at(self, num_tokens: int) -> float:
    """ms of a T-token forward: known, or linear between known T."""
    known = sorted(self.forward_ms)
    if num_tokens in self.forward_ms:
      return self.forward_ms[num_tokens]
    if not known[0] <= num_tokens <= known[-1]:
      raise ValueError(f"T={num_tokens} is outside the measured range "
                       f"{known[0]}..{known[-1]}; measure it.")
    hi = next(t for t in known if t > num_tokens)
    lo = max(t for t in known if t < num_tokens)
    w = (num_tokens - lo) / (hi - lo)
    return (1 - w) * self.forward_ms[lo] + w * self.forward_ms[hi]

  def drafting_ms(self, num_drafts: int) -> float:
    """ms a draft model spends proposing `num_drafts` tokens: a two-token
    catch-up pass, then num_drafts - 1 one-token forwards (0 for none).
    Costs known at T = 1 only price the first pass as one forward."""
    if num_drafts <= 0:
      return 0.0
    first = self.at(2) if max(self.forward_ms) >= 2 else self.at(1)
    return first + (num_drafts - 1) * self.at(1)


@dataclasses.dataclass(frozen=True)
class Roofline:
  """A forward's time from its bytes and FLOPs.

  Attributes:
    bandwidth: bytes per second read from memory.
    flops: float32 multiply-adds x 2 per second at full occupancy.
    overhead_ms: fixed cost of one forward (dispatch, kernel launches).
    source: "nominal" or "measured".
  """

  bandwidth: float
  flops: float
  overhead_ms: float
  source: str = "nominal"

  @classmethod
  def nominal(cls) -> "Roofline":
    """This backend's device by its nominal figures, needing no timing
    (`hardware.nominal_rates`)."""
    return cls(**hardware.nominal_rates())

  @classmethod
  def cached(cls, cache_dir: str | os.PathLike | None = None
             ) -> "Roofline":
    """What the tuning step measured on this machine
    (`measured.machine_rates`), else `nominal`."""
    rates = measured.machine_rates(cache_dir)
    return cls.nominal() if rates is None else cls(**rates,
                                                   source="measured")

  def forward(self, model: LanguageModel, *, batch: int,
              chunks: Sequence[int], cache_size: int) -> ForwardCosts:
    """`model`'s forward times at B and S for each T in `chunks`, from its
    declared geometry (`DeclaredModel.cost_geometry`)."""
    g = declared(model).cost_geometry()
    kv_bytes = g.kv_bytes_per_slot * batch * cache_size
    ms = {}
    for t in chunks:
      rows = batch * t
      # Each row multiplies its own k experts; the pass reads their union.
      flops = (2.0 * g.weight_bytes / g.itemsize * rows
               + g.attention_flops_per_slot * rows * cache_size)
      seconds = max((g.bytes_read(rows) + kv_bytes) / self.bandwidth,
                    flops / self.flops)
      ms[int(t)] = 1e3 * seconds + self.overhead_ms
    return ForwardCosts(batch, ms, "roofline")

  def prefill_ms(self, model: LanguageModel, *, batch: int, width: int,
                 cache_size: int, longest: int | None = None) -> float:
    """ms `model` spends prefilling a prompt buffer [B, P = `width`] at S
    whose longest prompt has `longest` tokens (default P): the passes
    `Decoder.prefill` runs (`prefill_passes`)."""
    passes = prefill_passes(width if longest is None else longest, width,
                            cache_size)
    costs = self.forward(model, batch=batch, chunks=sorted(set(passes)),
                         cache_size=cache_size)
    return sum(costs.at(t) for t in passes)


def survival(acceptance: Sequence[float], gamma: int) -> np.ndarray:
  """[γ+1] P(τ > i) = Π_{j≤i} a_j for i = 0..γ, from at least γ
  conditional acceptances a_1, a_2, ..."""
  if len(acceptance) < gamma:
    raise ValueError(f"Need {gamma} acceptance values, got "
                     f"{len(acceptance)}.")
  return np.cumprod(np.concatenate(
      [[1.0], np.asarray(acceptance[:gamma], np.float64)]))


def expected_tokens(acceptance: Sequence[float], gamma: int) -> float:
  """E[τ] = 1 + Σ_{i≤γ} Π_{j≤i} a_j for conditional acceptances a_j.

  Args:
    acceptance: a_1, a_2, ...: P(position j accepted | all before were);
      at least γ values.
    gamma: γ >= 0.
  """
  return float(survival(acceptance, gamma).sum())


def expected_steps(acceptance: Sequence[float], gamma: int, tokens: int,
                   batch: int = 1) -> float:
  """E[steps] until every one of `batch` rows has emitted `tokens` tokens.

  A step emits τ tokens per row, P(τ > i) = Π_{j≤i} a_j for i ≤ γ (the
  last step's are cut at the row's end), independently across rows and
  steps; the batch runs until its slowest row ends, so this is E[max over
  rows of a row's steps] = Σ_{s≥0} (1 - F(s)^B), with F(s) the
  probability that one row is done after s steps (computed exactly by
  convolving τ's distribution). It exceeds tokens / E[τ] by the last
  step's overshoot and, for B > 1, by the spread between rows.

  Args:
    acceptance: a_1, a_2, ...: conditional acceptances, at least γ values.
    gamma: γ >= 0 (0: one token per step).
    tokens: tokens per row, >= 1.
    batch: B rows, >= 1.
  """
  if tokens < 1 or batch < 1:
    raise ValueError(f"tokens and batch must be >= 1, got {tokens} and "
                     f"{batch}.")
  survive = survival(acceptance, gamma)  # [γ+1] P(τ > i)
  emit = survive - np.append(survive[1:], 0.0)  # [γ+1] P(τ = i + 1)
  # After s steps: done = F(s); left[n] = P(the row has emitted n < tokens).
  done, left, steps = 0.0, np.eye(1, tokens)[0], 0.0
  while 1.0 - done ** batch > 1e-12 and left.any():
    steps += 1.0 - done ** batch
    spread = np.zeros(tokens + gamma + 1)
    for i, p in enumerate(emit):
      spread[i + 1:i + 1 + tokens] += p * left
    done += spread[tokens:].sum()
    left = spread[:tokens]
  return float(steps)


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """The forward costs one call's γ policy prices steps with.

  Attributes:
    max_gamma: G.
    target_ms: ms of a target pass of each width in `widths`.
    draft_ms: ms of each draft token after a step's first (0 for a
      drafter that runs no model).
    first_draft_ms: ms of a step's first draft token (the draft model's
      two-token catch-up pass).
    source: "table" (measured by the tuning step) or "roofline".
    widths: the target pass widths priced, from 1 to G + 1 (default all
      of `verify_widths(G)`; `for_call` keeps those worth compiling).
  """

  max_gamma: int
  target_ms: tuple[float, ...]
  draft_ms: float = 0.0
  first_draft_ms: float = 0.0
  source: str = "table"
  widths: tuple[int, ...] = ()

  def __post_init__(self):
    if not self.widths:
      object.__setattr__(self, "widths", verify_widths(self.max_gamma))

  def step_ms(self, k: int) -> float:
    """ms of a step that drafts k tokens (0: a plain step)."""
    width = int(width_index(self.widths, k + 1))
    return self.target_ms[width] + float(
        drafting_ms(k, self.first_draft_ms, self.draft_ms))

  def rate(self, acceptance: Sequence[float], k: int) -> float:
    """Tokens per ms of one row drafting k tokens a step, at conditional
    acceptances a_1, a_2, ... (at least k of them)."""
    return expected_tokens(acceptance, k) / self.step_ms(k)

  def tokens_per_s(self, acceptance: Sequence[float], k: int, *,
                   batch: int = 1, tokens: int | None = None) -> float:
    """Predicted tokens/s of B rows drafting k tokens every step (0:
    autoregressive decoding), at conditional acceptances a_1, a_2, ...

    Args:
      acceptance: at least k conditional acceptances.
      k: drafts a step, 0 to G.
      batch: B rows.
      tokens: tokens per row of one generation, or None for the steady
        state. With it, the batch's steps are `expected_steps`: the
        generation ends with its slowest row, and rows that finished
        earlier idle through its last steps.
    """
    per_step = (expected_tokens(acceptance, k) if tokens is None
                else tokens / expected_steps(acceptance, k, tokens, batch))
    return batch * per_step / (self.step_ms(k) / 1e3)

  def policy_kwargs(self) -> dict[str, Any]:
    """`Auto.create`'s cost arguments."""
    return {"max_gamma": self.max_gamma, "target_ms": list(self.target_ms),
            "draft_ms": self.draft_ms, "first_draft_ms": self.first_draft_ms,
            "widths": self.widths}

  @classmethod
  def from_forwards(cls, max_gamma: int, target: ForwardCosts,
                    draft: ForwardCosts | None, source: str = "table"
                    ) -> "StepCosts":
    """From the target's forward costs at every width and the draft
    model's at T = 1 and 2 (None: a drafter that runs no model)."""
    return cls(max_gamma=max_gamma,
               target_ms=tuple(target.at(w) for w in verify_widths(max_gamma)),
               draft_ms=draft.at(1) if draft else 0.0,
               first_draft_ms=draft.drafting_ms(1) if draft else 0.0,
               source=source)

  @classmethod
  def for_fixed(cls, gamma: int, target: ForwardCosts,
                draft: ForwardCosts | None = None) -> "StepCosts":
    """The costs of a fixed γ (0: autoregressive decoding), at its own
    widths, so that its γ + 1-token pass is priced as measured (or
    interpolated between measured T)."""
    return cls.from_forwards(max(int(gamma), 1), target, draft)

  @classmethod
  def for_call(cls, target: LanguageModel, cost_model: LanguageModel | None,
               *, batch: int, cache_size: int, max_gamma: int,
               cache_dir: str | os.PathLike | None = None) -> "StepCosts":
    """The costs of a call at B and S: the tuning step's tables where both
    models have one (`measured.forward_ms`), else the roofline
    (`Roofline.cached`). `cost_model` is the drafter's
    (`Drafter.cost_model`; None: it runs no model)."""
    widths = verify_widths(max_gamma)
    where = dict(batch=batch, cache_size=cache_size)
    table = measured.forward_ms(target, chunks=widths, cache_dir=cache_dir,
                                **where)
    draft_table = None if cost_model is None else measured.forward_ms(
        cost_model, chunks=(1, 2), cache_dir=cache_dir, **where)
    if table is not None and (cost_model is None or draft_table is not None):
      draft = (None if draft_table is None
               else ForwardCosts(batch, draft_table, "cache"))
      return cls.from_forwards(max_gamma, ForwardCosts(batch, table, "cache"),
                               draft, "table")
    roofline = Roofline.cached(cache_dir)
    model = roofline.forward(target, chunks=widths, **where)
    draft = None if cost_model is None else roofline.forward(
        cost_model, chunks=(1, 2), **where)
    return cls.from_forwards(max_gamma, model, draft,
                             "roofline").worth_compiling()

  def worth_compiling(self, tolerance: float = 0.05) -> "StepCosts":
    """These costs at the widths worth a compiled pass of their own: 1,
    G + 1, and each width between whose pass costs at least `tolerance`
    less than the next larger one kept. Each width is another target
    forward in the program: where passes cost alike (a memory-bound
    accelerator), a short proposal loses nothing by the wider pass and
    the program compiles fewer forwards."""
    kept = [len(self.widths) - 1]
    for i in range(len(self.widths) - 2, 0, -1):
      if self.target_ms[i] <= (1.0 - tolerance) * self.target_ms[kept[-1]]:
        kept.append(i)
    kept = sorted(kept + [0])
    return dataclasses.replace(
        self, widths=tuple(self.widths[i] for i in kept),
        target_ms=tuple(self.target_ms[i] for i in kept))
