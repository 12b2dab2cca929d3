"""Sampling parameters and logits -> processed probabilities.

Shape letters (`specjax.shapes`): V vocab; `...` any leading batch/position
axes.

Temperature, top-k, top-p and min-p are traced scalars, so changing them never
recompiles; the branches (greedy, plain softmax, sorted filtering) are chosen
with `lax.cond` at run time. Greedy (temperature 0) is a one-hot distribution
at the argmax, so the rejection sampler treats it like any other distribution.
The same processing is applied to draft and target logits, which is what makes
speculative sampling reproduce the target's *processed* distribution. The
history-dependent controls (penalties, logit bias, a grammar's mask;
`specjax.controls`) come first, on the raw logits, each position with its
own history.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import controls as controls_lib
from specjax import processors


# The name scope of the choice between greedy and sampled probabilities.
SCOPE = "sampling"


@flax.struct.dataclass(kw_only=True)
class SamplingParams:
  """Traced sampling settings, shared by every row of a batch.

  Attributes:
    temperature: [] float32; 0 means greedy.
    top_k: [] int32; keep the k most likely tokens, 0 disables.
    top_p: [] float32 in (0, 1]; keep the smallest set with this much mass.
    min_p: [] float32 in [0, 1]; keep the tokens whose probability is at
      least min_p times the most likely one's (after temperature), 0
      disables.
    controls: penalties, logit bias and a grammar with the history they
      read (`specjax.controls.Controls`, per row and position), or None.
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array | None = None
  controls: controls_lib.Controls | None = None

  @classmethod
  def create(cls, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float | None = None,
             controls: controls_lib.Controls | None = None
             ) -> "SamplingParams":
    """Validates host values and wraps them as arrays (`min_p` None: not
    in the program; any value, 0 included, is traced)."""
    if isinstance(temperature, bool) or not isinstance(
        temperature, (int, float, np.number)):
      raise ValueError(f"temperature must be a number, got {temperature!r}.")
    temperature, top_p = float(temperature), float(top_p)
    if not temperature >= 0.0:  # also rejects NaN
      raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if int(top_k) != top_k or top_k < 0:
      raise ValueError(f"top_k must be a non-negative integer, got {top_k}.")
    # Numpy leaves: a jitted call transfers them without compiling
    # anything (`jnp.float32(x)` compiles a conversion program).
    return cls(temperature=np.float32(temperature),
               top_k=np.int32(top_k), top_p=np.float32(top_p),
               min_p=processors.setting("min_p", min_p),
               controls=controls)

  def advance(self, tokens: jax.Array,
              take: jax.Array | None = None) -> "SamplingParams":
    """These settings after one more token [B] per row (rows where `take`
    [B] holds; default all): the controls' history moves on."""
    if self.controls is None:
      return self
    return self.replace(controls=self.controls.advance(tokens, take))

  def along_chain(self, tokens: jax.Array) -> "SamplingParams":
    """These settings at each position of a verified chain, position i
    after drafts [B, G] tokens[:, :i] (`Controls.along_chain`)."""
    if self.controls is None:
      return self
    return self.replace(controls=self.controls.along_chain(tokens))

  def along_tree(self, tokens: jax.Array, parents: jax.Array,
                 ancestors: jax.Array) -> "SamplingParams":
    """These settings at the root and after each node of a token tree
    (`Controls.along_tree`)."""
    if self.controls is None:
      return self
    return self.replace(controls=self.controls.along_tree(tokens, parents,
                                                          ancestors))

  @property
  def greedy(self) -> jax.Array:
    return self.temperature == 0.0


def host_key(seed: int) -> jax.Array:
  """`jax.random.key(seed)`, made without compiling anything.

  `jax.random.key` runs a seeding program, compiled once per process: a
  helper compilation in every fresh process's first call. The default
  implementation's key data for 0 <= seed < 2^32 is [0, seed], which is
  wrapped on the host instead; other seeds and implementations use
  `jax.random.key`.
  """
  if isinstance(seed, bool) or int(seed) != seed:
    raise ValueError(f"A seed must be an integer, got {seed!r}.")
  seed = int(seed)
  if 0 <= seed < 2**32 and (
      jax.config.jax_default_prng_impl == "threefry2x32"):
    return jax.random.wrap_key_data(np.array([0, seed], np.uint32))
  return jax.random.key(seed)


# Vocabulary blocks of the two-level searches (`argmax`, `sample`): XLA's CPU
# argmax and cumsum over a whole row are serial, and blocks of 128 are an
# order of magnitude faster at V = 152k (`scripts/bench_sampling.py`).
BLOCK = 128


def _blocks(x: jax.Array, fill: float) -> jax.Array:
  """[..., V] -> [..., ceil(V / BLOCK), BLOCK], the tail padded with
  `fill`."""
  pad = -x.shape[-1] % BLOCK
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)],
                constant_values=fill)
  return x.reshape(x.shape[:-1] + (-1, BLOCK))


def _row(blocks: jax.Array, index: jax.Array) -> jax.Array:
  """[..., N, BLOCK] at [...] block indices -> [..., BLOCK]."""
  return jnp.take_along_axis(blocks, index[..., None, None], axis=-2)[..., 0, :]


def argmax(x: jax.Array) -> jax.Array:
  """[..., V] -> [...] int32 index of the maximum, the first on ties, as
  `jnp.argmax`: the block holding it (the first block whose maximum is
  the row's), then the index within that block."""
  if x.shape[-1] <= BLOCK:  # one block: nothing to search first
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  blocks = _blocks(x, -jnp.inf)
  block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # [...]
  inner = jnp.argmax(_row(blocks, block), axis=-1)
  return (block * BLOCK + inner).astype(jnp.int32)


def top_probability(logits: jax.Array) -> jax.Array:
  """[..., V] -> [...] float32 the largest softmax probability, the raw
  model's confidence: 1 / Σ exp(logit - max), without the [..., V]
  softmax."""
  logits = logits.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  return 1.0 / jnp.sum(jnp.exp(logits - top), axis=-1)


def greedy_probs(logits: jax.Array) -> jax.Array:
  """[..., V] -> one-hot [..., V] float32 at the argmax (first on ties)."""
  return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)


def _order_keys(x: jax.Array) -> jax.Array:
  """float32 [..., V] -> uint32 keys in the same order (-inf lowest)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  bits = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
  return jax.lax.bitcast_convert_type(bits, jnp.uint32) ^ jnp.uint32(
      0x80000000)


def _smallest_key(holds, lo: jax.Array, hi: jax.Array) -> jax.Array:
  """The smallest uint32 key K in [lo, hi] for which `holds(K)` ([..., 1]
  bool, false then true as K grows; true at hi), by bisection: 32 passes
  over the row, where a sort of a large vocabulary compiles and runs far
  slower on TPU."""
  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    yes = holds(mid)
    return jnp.where(yes, lo, mid + 1), jnp.where(yes, mid, hi)
  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _filtered_logits(scaled: jax.Array, top_k: jax.Array,
                     top_p: jax.Array) -> jax.Array:
  """Masks to -inf what top-k then top-p remove. [..., V] -> [..., V].

  Top-k keeps the tokens at least as likely as the k-th; top-p then keeps,
  from the most likely down, each token whose more likely tokens hold less
  than top_p of the top-k mass. Ties at either threshold are kept (as
  Hugging Face's warpers do). Both thresholds are found by bisection over
  the logits' order (`_smallest_key`), with no sort.
  """
  vocab = scaled.shape[-1]
  keys = _order_keys(scaled)  # [..., V]
  lo = jnp.min(keys, axis=-1, keepdims=True)
  hi = jnp.max(keys, axis=-1, keepdims=True)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  # The k-th largest key: the smallest K with fewer than k keys above it.
  kth = _smallest_key(
      lambda t: jnp.sum(keys > t, axis=-1, keepdims=True) < k, lo, hi)
  in_top_k = keys >= kth
  top = jnp.max(scaled, axis=-1, keepdims=True)
  weights = jnp.where(in_top_k, jnp.exp(scaled - top), 0.0)
  probs = weights / jnp.sum(weights, axis=-1, keepdims=True)
  # The last kept key: the smallest K (within the top k) whose more
  # likely tokens hold less than top_p.
  threshold = _smallest_key(
      lambda t: jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1,
                        keepdims=True) < top_p, kth, hi)
  return jnp.where(keys >= threshold, scaled, -jnp.inf)


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Processed next-token distribution.

  Args:
    logits: [..., V] float.
    params: sampling settings.

  Returns:
    [..., V] float32 probabilities: one-hot argmax when greedy, otherwise
    softmax(logits / temperature) restricted to top-k, then top-p.
  """
  logits = logits.astype(jnp.float32)
  if params.controls is not None:
    logits = params.controls.apply(logits)

  def sampled(logits):
    scaled = logits / params.temperature
    filtering = (params.top_k > 0) | (params.top_p < 1.0)
    scaled = jax.lax.cond(
        filtering, lambda s: _filtered_logits(s, params.top_k, params.top_p),
        lambda s: s, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if params.min_p is not None:
      # Hugging Face's `MinPLogitsWarper`, after top-k and top-p.
      top = jnp.max(probs, axis=-1, keepdims=True)
      probs = jnp.where(probs >= params.min_p * top, probs, 0.0)
      probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs

  # Named, so a count of the compiled program can price a greedy run by
  # the branch it takes (`specjax.aot.hlo.count`'s `cheapest`).
  with jax.named_scope(SCOPE):
    return jax.lax.cond(params.greedy, greedy_probs, sampled, logits)


def _first(mask: jax.Array) -> jax.Array:
  """[..., N] bool -> [...] int32 index of the first True, N if none."""
  n = mask.shape[-1]
  return jnp.min(jnp.where(mask, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one token per distribution by inverting its CDF.

  One uniform u per row instead of Gumbel noise over the whole vocabulary,
  found in two levels: the first block of `BLOCK` tokens whose cumulative
  mass exceeds u, then the first token in it whose cumulative mass exceeds
  what is left of u (one serial cumsum over a row is slow on CPU:
  `scripts/bench_sampling.py`). A vocabulary of one block (V <= `BLOCK`)
  is searched in one level.
  Zero-probability tokens have empty CDF intervals and are never drawn, so
  one-hot (greedy) distributions return their hot index exactly.

  Args:
    key: PRNG key.
    probs: [..., V] probabilities (need not be normalised).

  Returns:
    [...] int32 token ids.
  """
  probs = probs.astype(jnp.float32)
  u = jax.random.uniform(key, probs.shape[:-1] + (1,))  # [..., 1]
  if probs.shape[-1] <= BLOCK:  # one block: the row is the block
    row, offset = probs, 0
    u = u * jnp.sum(probs, axis=-1, keepdims=True)
  else:
    blocks = _blocks(probs, 0.0)  # [..., N, BLOCK]
    mass = jnp.sum(blocks, axis=-1)  # [..., N]
    cdf = jnp.cumsum(mass, axis=-1)
    u = u * cdf[..., -1:]
    # Rounding can leave u at the total mass: the last block then.
    block = jnp.minimum(_first(cdf > u), mass.shape[-1] - 1)  # [...]
    # The mass before the block, as `cdf` summed it (not cdf - mass, whose
    # rounding could exceed u and let a zero-probability token through).
    before = jnp.take_along_axis(
        jnp.concatenate([jnp.zeros_like(cdf[..., :1]), cdf[..., :-1]], -1),
        block[..., None], axis=-1)  # [..., 1]
    row, offset, u = _row(blocks, block), block * BLOCK, u - before
  inner = _first(jnp.cumsum(row, axis=-1) > u)  # row: [..., BLOCK or V]
  token = offset + inner
  # Where rounding leaves u past the row's own sum: the argmax.
  found = inner < row.shape[-1]
  return jax.lax.cond(jnp.all(found), lambda: token,
                      lambda: jnp.where(found, token, argmax(probs)))
