"""Measured forward costs: the tuning step behind `gamma="auto"`.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, T
tokens per forward, G = γ.

`measure` times each model's forward at the chunk lengths T a step runs,
per batch size and cache size, and caches the table on disk per machine
and shapes (`specjax.policies.measured` reads it back); `step_costs` turns
the tables into the `policies.StepCosts` that `gamma="auto"` prices its
steps by (the throughput model itself is described in
`specjax.policies.costs`). This is the explicit tuning step (`python -m
specjax.tune`), on any backend; nothing here runs inside a user's call.
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import hardware
from specjax import padding
from specjax import sampling
from specjax import store
from specjax.models.protocol import model_output
from specjax.policies.costs import ForwardCosts
from specjax.policies.costs import StepCosts
from specjax.policies.measured import check_entry
from specjax.policies.measured import table_key
from specjax.verify import verify_widths

__all__ = ["AGREE", "DRIFT", "PASSES", "READ_BYTES", "RECHECK",
           "RECHECK_MIN_S", "compiled_forward_hlo", "forward_step",
           "measure", "read_step", "step_costs"]

READ_BYTES = 1 << 30


@functools.partial(jax.jit, donate_argnums=(2,))
def _forwards(model, tokens, cache, n):
  """n forwards of tokens [B, T] at the cache's lengths in one compiled
  loop -> the last one's [B] argmax; the cache unchanged. Iteration i
  reads the tokens shifted by i, so that only what a generation's loop
  holds fixed (the weights) is invariant in it."""
  start = cache.lengths
  vocab = model.vocab_size - 1

  def body(i, carry):
    _, cache = carry
    out, cache = model((tokens - 1 + i) % vocab + 1, cache)  # [B, T, V]
    logits = model_output(out).logits
    return sampling.argmax(logits[:, -1]), cache.rollback(start)

  first = jnp.zeros(tokens.shape[:1], jnp.int32)
  return jax.lax.fori_loop(0, n, body, (first, cache))


@jax.jit
def _prefill(model, tokens, lengths, cache):
  return model.prefill(tokens, lengths, cache)


def compiled_forward_hlo(model: Any, tokens: jax.Array, cache: Any) -> str:
  """The optimised HLO text of the loop `forward_step` runs."""
  return _forwards.lower(model, tokens, cache,
                         jnp.int32(1)).compile().as_text()


def forward_step(model: Any, prompts: Sequence[Sequence[int]],
                 cache_size: int, num_tokens: int
                 ) -> Callable[..., jax.Array]:
  """A callable running jitted forwards of `num_tokens` tokens per row.

  Args:
    model: a `LanguageModel`.
    prompts: B prompts; they are prefilled first, so attention reads a warm
      cache of realistic length.
    cache_size: S.
    num_tokens: T (1 for a decode step, γ+1 for a verification pass).

  Returns:
    A function of n (default 1) running n forwards in one compiled loop,
    as a generation runs them (`hardware.looped_ms` times one more), and
    returning the last one's [B] argmax tokens; each call donates the
    cache and gets it back rolled back, unchanged.
  """
  tokens, lengths, _ = padding.prepare_prompts(
      prompts, model.vocab_size, max_new_tokens=1, cache_size=cache_size)
  tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)  # [B, P], [B]
  _, cache = _prefill(model, tokens, lengths,
                      model.init_cache(tokens.shape[0], cache_size))
  # Distinct tokens, as drafts are: a mixture of experts routes them to
  # as many experts as a real verification pass wakes, not to one token's.
  chunk = (tokens[:, :1] + 13 * jnp.arange(num_tokens)[None]) % (
      model.vocab_size - 1) + 1  # [B, T]
  state = {"cache": cache}

  def step(n: int = 1):
    out, state["cache"] = _forwards(model, chunk, state["cache"],
                                    jnp.int32(n))
    return out

  return step


def read_step(num_bytes: int = READ_BYTES) -> Callable[[], jax.Array]:
  """A callable that reads a `num_bytes` float32 array once (a jitted sum)."""
  data = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  return lambda: total(data)


# A table is the per-T mean of its last `PASSES` passes (a pass times every
# chunk, `repeats` timings each, and keeps each chunk's median),
# taken at different moments. Two passes agree when every T's times are
# within `AGREE` of each other. A process times a table once more at its
# first read and whenever it is due; a pass more than `DRIFT` away from
# the table means the machine changed, and the table's passes are
# discarded. The next pass is due `RECHECK_MIN_S` seconds after one that
# disagreed with the table or while the table has fewer than `PASSES`
# passes, else once the process has run `RECHECK` times as long as the
# pass's calls took (at least `RECHECK_MIN_S`).
PASSES = 8
AGREE = 0.05
DRIFT = 0.5
RECHECK = 50
RECHECK_MIN_S = 60.0
# key -> time.monotonic() after which this process times the table again.
_DUE: dict[str, float] = {}


def _mean(passes: Sequence[dict[int, float]]) -> dict[int, float]:
  """Per T, the mean ms over passes (each T -> ms)."""
  return {t: float(np.mean([p[t] for p in passes])) for t in passes[0]}


def measure(model: Any, *, batch: int, chunks: Sequence[int],
            cache_size: int = 512, prompt_tokens: int | None = None,
            repeats: int = 5, cache_dir: str | os.PathLike | None = None,
            refresh: bool = False, check: bool = True) -> ForwardCosts:
  """Forward times of `model` at B = `batch` for each T in `chunks`.

  Measured once per machine, model, plan, B, S and chunks, then read from
  `<cache>/tuning/cost.json` (deleting it re-measures; `refresh` forces
  it) and timed again from time to time while in use. Each forward runs
  after a prefill of `prompt_tokens` (default S / 2), so attention reads a
  cache of realistic length.

  A machine's speed is not fixed (a shared host, a hypervisor's share of
  the CPU, a process that has not quite ended), and it need not change
  alike at every T: a forward can switch every few seconds between two
  speeds, which moves t(γ+1)/t(1) and so the α from which drafting pays.
  A timing of a few seconds falls in one state, and so would the median
  of a few of them. What a generation pays is the mean over time, so a
  table is the mean of passes taken at different moments:

  - a new table takes two passes, and a third when they do not `AGREE`;
    while it has fewer than `PASSES`, another pass is due every
    `RECHECK_MIN_S` seconds of a process that reads it;
  - with `check`, the first read of a table in a process takes a pass,
    and so does a read once one is due: after `RECHECK_MIN_S` when the
    last pass did not agree with the table, else after `RECHECK` times
    its calls' time (at least `RECHECK_MIN_S`). So a long run (a server,
    a benchmark sweep) keeps sampling the machine at a cost of about
    1/`RECHECK` of its time, and the table follows a lasting change over
    `PASSES` passes; one bad moment moves it by 1/`PASSES` of its error;
  - a pass more than `DRIFT` away from the table at any T means the
    machine has changed (a table copied from another host, a different
    share of it): the table is measured anew.

  Attention reads all S slots of the static cache whatever the rows'
  lengths, so a forward's cost grows with S; measure at the S the
  generation will use, or the verify pass's cost relative to a one-token
  step comes out wrong.

  Each T is timed as one more forward of a compiled loop of them
  (`hardware.looped_ms`), as a generation runs its plain steps and its
  verification passes: neither a call's dispatch, nor what XLA hoists
  out of the loop, nor a wider forward just before it is priced in.
  """
  chunks = tuple(sorted(set(int(t) for t in chunks)))
  path = store.path_for("cost", cache_dir)
  entries = store.read(path, check_entry)
  key = table_key(model, batch, cache_size, chunks)
  passes = []
  if key in entries and not refresh:
    entry = entries[key]
    passes = [{int(t): float(v) for t, v in p.items()}
              for p in entry.get("passes", [entry["forward_ms"]])]
    cached = ForwardCosts(batch, _mean(passes), "cache")
    if not check or time.monotonic() < _DUE.get(key, 0.0):
      return cached
  if prompt_tokens is None:
    prompt_tokens = cache_size // 2
  if not 1 <= prompt_tokens <= cache_size - chunks[-1]:
    raise ValueError(f"prompt_tokens={prompt_tokens} and a {chunks[-1]}-"
                     f"token forward do not fit a cache of {cache_size}.")
  prompts = [[(7 * i + b) % (model.vocab_size - 1) + 1
              for i in range(prompt_tokens)] for b in range(batch)]
  steps = {t: forward_step(model, prompts, cache_size, t) for t in chunks}
  timed = lambda: hardware.looped_ms(steps, repeats)
  new = [timed()]
  if passes and not hardware.agree_ms(new[0], cached.forward_ms, DRIFT):
    passes = []  # the machine has changed
  # The next pass is due soon while the table is young or when this one
  # disagreed with it (two moments decide, not two passes of one), else
  # in proportion to what a pass costs.
  soon = not passes or not hardware.agree_ms(new[0], cached.forward_ms,
                                             AGREE)
  if not passes:  # a new table: two passes, and a third if they differ
    new.append(timed())
    if not hardware.agree_ms(*new, AGREE):
      new.append(timed())
  passes = (passes + new)[-PASSES:]
  ms = _mean(passes)
  wait_s = RECHECK_MIN_S
  if len(passes) >= PASSES and not soon:
    wait_s = max(RECHECK * repeats * sum(new[-1].values()) / 1e3, wait_s)
  _DUE[key] = time.monotonic() + wait_s
  as_json = lambda times: {str(t): v for t, v in times.items()}
  entries[key] = {"forward_ms": as_json(ms),
                  "passes": [as_json(p) for p in passes],
                  "measured": datetime.datetime.now().isoformat(
                      timespec="seconds")}
  store.write(path, entries)
  return ForwardCosts(batch, ms)


def step_costs(target: Any, drafter: Any, *, batch: int, max_gamma: int,
               cache_size: int, cache_dir: str | os.PathLike | None = None,
               **kwargs: Any) -> StepCosts:
  """The tuning step for a call's γ policy: `measure` the target at every
  verification width and the drafter's `cost_model` (if any) at T = 1 and
  2, at B and S, and return them as `StepCosts`. The tables are cached,
  so `speculative_generate(gamma="auto")` at the same B and S then reads
  them (`StepCosts.for_call`); `kwargs` go to `measure`."""
  where = dict(batch=batch, cache_size=cache_size, cache_dir=cache_dir,
               **kwargs)
  target_costs = measure(target, chunks=verify_widths(max_gamma), **where)
  model = drafter.cost_model
  draft_costs = None if model is None else measure(model, chunks=(1, 2),
                                                   **where)
  return StepCosts.from_forwards(max_gamma, target_costs, draft_costs)
