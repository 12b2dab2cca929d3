"""Token trees: static-shape arrays, tree attention and lossless verification.

Shape letters (`specjax.shapes`): B batch, T = num_nodes draft tokens, G = γ
the deepest node, V vocab.

A tree proposal is a `Proposal` with `parents` set: node i's token
`tokens[b, i]` follows node `parents[b, i]` (-1: the last committed token,
the root), nodes are in topological order (a parent comes before its
children), `valid [B, T]` says which nodes exist, and `depth [B, T]` is
each node's distance from the root (1 for the root's children). A chain is
the tree with parents i - 1.

The target scores the root and all T nodes in one pass: node i sits at
position `length + depth[i]` and attends to the cache, the root and its own
ancestors (`ancestor_mask`), through the model's chunk-mask seam.

Verification (`verify_tree`) is SpecInfer's multi-candidate speculative
sampling (Miao et al. 2024, "SpecInfer", Algorithm 2; the "recursive
rejection sampling" of Jeon et al. 2024 covers drawing without replacement):
walking down from the root with r = p(· | node), each child x_i of the
current node, in index order, is accepted with probability
min(1, r(x_i) / q_i(x_i)); on a rejection r becomes norm(max(r - q_i, 0));
on an acceptance the walk moves to that child with r = p(· | child); when
every child of the current node was rejected (or it has none), the next
token is drawn from r. q_i is the distribution child i was drawn from given
its earlier siblings: the drafter's q at the parent for children drawn with
replacement, that q renormalised without the earlier siblings for children
drawn without replacement, and one-hot at x_i for a child chosen
deterministically (`q=None`, never materialised: r(x_i) is then the
acceptance probability and the rejected token is removed from r).

The assumption a drafter must meet: the siblings of one node are distinct
tokens when they are deterministic, and every q_i is the law the token was
actually drawn from given the context, the tree built so far and its
earlier siblings, drawn with randomness independent of the verifier's.
Under that assumption the emitted tokens are distributed exactly as the
target's, for any tree shape; a deterministic choice (top-k children,
several n-gram matches) meets it for any rule that picks the candidates.
With one-hot p (greedy) the walk follows the child equal to the target's
argmax at each node: the longest greedy-matching path.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from specjax import sampling

__all__ = ["TreeWalk", "ancestor_mask", "depths", "path_slots",
           "residual_after", "walk"]

# Residual mass below this is treated as zero (see specjax.rejection).
_RESIDUAL_EPS = 1e-9


def depths(parents: jax.Array) -> jax.Array:
  """parents [B, T] (topological, -1 the root) -> depth [B, T] int32, 1 for
  the root's children."""
  batch, size = parents.shape

  def body(i, depth):
    parent = parents[:, i]
    above = jnp.take_along_axis(depth, jnp.maximum(parent, 0)[:, None],
                                axis=1)[:, 0]
    return depth.at[:, i].set(jnp.where(parent < 0, 1, above + 1))

  return jax.lax.fori_loop(0, size, body,
                           jnp.zeros((batch, size), jnp.int32))


def ancestor_mask(parents: jax.Array, valid: jax.Array) -> jax.Array:
  """[B, T+1, T+1] bool: chunk token u (0 the root, i + 1 node i) reads
  chunk token w when w is u itself or one of its ancestors. Invalid nodes
  read only the root and themselves (their outputs are never used)."""
  batch, size = parents.shape
  eye = jnp.eye(size + 1, dtype=bool)
  mask = jnp.broadcast_to(eye, (batch, size + 1, size + 1))
  mask = mask.at[:, :, 0].set(True)

  def body(i, mask):
    parent_row = jnp.take_along_axis(
        mask, (jnp.maximum(parents[:, i], -1) + 1)[:, None, None], axis=1
    )[:, 0]  # [B, T+1] the parent's ancestors
    row = jnp.where(valid[:, i, None], parent_row, mask[:, i + 1])
    return mask.at[:, i + 1].set(row | eye[i + 1])

  return jax.lax.fori_loop(0, size, body, mask)


def residual_after(residual: jax.Array, q: jax.Array) -> jax.Array:
  """[B, V] r after a rejected child drawn from q [B, V]: norm(max(r - q,
  0)), or r itself where nothing is left (r == q up to rounding)."""
  left = jnp.maximum(residual - q, 0.0)
  mass = jnp.sum(left, axis=-1, keepdims=True)
  return jnp.where(mass > _RESIDUAL_EPS, left / jnp.maximum(mass, 1e-30),
                   residual)


@flax.struct.dataclass(kw_only=True)
class TreeWalk:
  """The verifier's walk down a tree.

  Attributes:
    num_accepted: [B] int32 accepted nodes (the path's length).
    path: [B, G] int32 chunk indices (node + 1) of the accepted nodes in
      order; junk past `num_accepted`.
    next_token: [B] int32 drawn after the path.
  """

  num_accepted: jax.Array
  path: jax.Array
  next_token: jax.Array


def walk(key: jax.Array, tokens: jax.Array, parents: jax.Array,
         valid: jax.Array, q: jax.Array | None, p: jax.Array, gamma: int,
         child: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
         | None = None) -> TreeWalk:
  """Multi-candidate speculative sampling down a tree (module docstring).

  Args:
    key: PRNG key.
    tokens: [B, T] int32 node tokens.
    parents: [B, T] int32 (-1 the root; topological order).
    valid: [B, T] bool nodes that exist.
    q: [B, T, V] the law each node was drawn from given its earlier
      siblings, or None for deterministic nodes (one-hot).
    p: [B, T+1, V] the target's distributions after the root and each node.
    gamma: G, the deepest node (static; sizes `path`).
    child: the verdict on a tried child from uniform u [B], its draft law's
      q_x [B] and the residual's r_x [B] at its token ([B] bool; an
      `Acceptance`'s `child`); default exact, u q_x < r_x.

  Returns:
    The `TreeWalk`.
  """
  verdict = child or (lambda u, q_x, r_x: u * q_x < r_x)
  batch, size = tokens.shape
  accept_key, next_key = jax.random.split(key)
  u = jax.random.uniform(accept_key, (batch, size))
  rows = jnp.arange(batch)

  def body(i, carry):
    current, residual, path, count = carry
    tried = valid[:, i] & (parents[:, i] + 1 == current)  # [B]
    x = tokens[:, i]
    r_x = residual[rows, x]
    if q is None:
      q_x = jnp.ones_like(r_x)
      drop = jax.nn.one_hot(x, residual.shape[-1], dtype=residual.dtype)
    else:
      q_x = q[rows, i, x]
      drop = q[:, i]
    accept = tried & verdict(u[:, i], q_x, r_x)
    reject = tried & ~accept
    residual = jnp.where(accept[:, None], p[:, i + 1],
                         jnp.where(reject[:, None],
                                   residual_after(residual, drop), residual))
    slot = jnp.minimum(count, gamma - 1)
    path = path.at[rows, slot].set(jnp.where(accept, i + 1, path[rows, slot]))
    return (jnp.where(accept, i + 1, current), residual, path,
            count + accept.astype(jnp.int32))

  carry = (jnp.zeros((batch,), jnp.int32), p[:, 0],
           jnp.zeros((batch, gamma), jnp.int32),
           jnp.zeros((batch,), jnp.int32))
  _, residual, path, count = jax.lax.fori_loop(0, size, body, carry)
  return TreeWalk(num_accepted=count, path=path,
                  next_token=sampling.sample(next_key, residual))


def path_slots(path: jax.Array, num_accepted: jax.Array) -> jax.Array:
  """[B, G] chunk indices of the accepted path, with the unaccepted tail
  pointing at the root (index 0): gathers stay in range."""
  slots = jnp.arange(path.shape[1])[None]
  return jnp.where(slots < num_accepted[:, None], path, 0)
