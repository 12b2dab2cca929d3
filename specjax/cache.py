"""`KVCache`: an explicit key/value cache pytree with per-row lengths.

Shape letters (`specjax.shapes`): L layers, B batch, S cache size, K key/value
heads, D head dim, T tokens written in one call.

Each row has its own length (rows of a batch accept different numbers of draft
tokens). Writing a chunk puts T tokens at positions `lengths[b] + t`; rollback
is setting `lengths`: positions at or past a row's length are stale, and the
attention mask never reads them.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from specjax.shapes import DATA
from specjax.shapes import MODEL
from specjax.shapes import mesh_axis


@flax.struct.dataclass(kw_only=True)
class KVCache:
  """Keys and values of every layer, and how much of each row is valid.

  Attributes:
    k: [L, B, S, K, D] keys, rotary embedding applied.
    v: [L, B, S, K, D] values.
    lengths: [B] int32, number of valid positions per row.
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def zeros(cls, *, num_layers: int, batch: int, size: int, num_kv_heads: int,
            head_dim: int, dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch, size, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def size(self) -> int:
    """S, the number of positions per row."""
    return self.k.shape[2]

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  def partition_spec(self, mesh: jax.sharding.Mesh) -> "KVCache":
    """How this cache splits over `mesh`: rows on `DATA`, key/value heads
    on `MODEL` (each device then attends with its own heads, as the
    sharded q/k/v projections produce them). An axis that does not divide
    its dimension is not used for it (e.g. K = 2 heads on a 4-way model
    axis stay whole on every device).

    Returns:
      A `KVCache` of `PartitionSpec`s (k, v over [L, B, S, K, D]).
    """
    data = mesh_axis(DATA, self.batch, mesh)
    model = mesh_axis(MODEL, self.k.shape[3], mesh)
    kv = PartitionSpec(None, data, None, model, None)
    return KVCache(k=kv, v=kv, lengths=PartitionSpec(data))

  def shard(self, mesh: jax.sharding.Mesh | None) -> "KVCache":
    """This cache laid out as `partition_spec` says (inside jit, a
    sharding constraint; outside, a transfer); unchanged when `mesh` is
    None."""
    if mesh is None:
      return self
    specs = self.partition_spec(mesh)
    return jax.lax.with_sharding_constraint(
        self, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, PartitionSpec)))

  def rollback(self, lengths: jax.Array) -> "KVCache":
    """Keeps the first `lengths[b]` positions of each row valid."""
    return self.replace(lengths=lengths.astype(jnp.int32))

  def write(self, keys: jax.Array, values: jax.Array, offsets: jax.Array,
            first: int = 0) -> "KVCache":
    """A chunk's keys and values written at each row's offset.

    Args:
      keys: [l, B, T, K, D] for layers `first` .. `first + l - 1`.
      values: [l, B, T, K, D].
      offsets: [B] int32 slot of each row's first chunk token.
      first: static, the first layer written.

    Returns:
      The cache with those T slots per row and layer written (nothing else
      copied) and `lengths = offsets + T`.
    """
    stop = first + keys.shape[0]
    rows = jax.vmap(write_rows, in_axes=(0, 0, None))
    k, v = rows(self.k[first:stop], keys, offsets), rows(
        self.v[first:stop], values, offsets)
    if (first, stop) != (0, self.k.shape[0]):
      k, v = self.k.at[first:stop].set(k), self.v.at[first:stop].set(v)
    return self.replace(k=k, v=v,
                        lengths=(offsets + keys.shape[2]).astype(jnp.int32))

  def compact(self, src_slots: jax.Array, lengths: jax.Array) -> "KVCache":
    """Moves chosen slots to consecutive positions after `lengths`.

    For a commit that is not a prefix (a path through a token tree): the
    keys and values in slots `src_slots[b, t]` are copied to slots
    `lengths[b] + t`, and the row's length becomes `lengths[b] + T`. Only
    those T slots per row and layer are written, never the whole cache. The
    keys keep the rotary phase of the position they were computed at, so a
    slot should land where its position says (a tree node at depth d sits
    at position `lengths + d`, which is where its path puts it).

    Args:
      src_slots: [B, T] int32 slots to gather (any order, may repeat,
        padded by the caller who then rolls back to a shorter length).
      lengths: [B] int32 committed length before the gathered slots.

    Returns:
      The cache with the gathered slots written and `lengths + T`.
    """
    # [L, B, S, K, D] gathered at [B, T] per row -> [L, B, T, K, D].
    take = jax.vmap(jax.vmap(lambda buf, idx: buf[idx]), in_axes=(0, None))
    return self.write(take(self.k, src_slots), take(self.v, src_slots),
                      lengths)


def write_rows(buffer: jax.Array, chunk: jax.Array,
               offsets: jax.Array) -> jax.Array:
  """Writes `chunk[b]` into `buffer[b]` starting at `offsets[b]` on axis 1.

  Args:
    buffer: [B, S, ...].
    chunk: [B, T, ...], T <= S.
    offsets: [B] int32; callers guarantee `offsets + T <= S` (XLA would clamp
      an out-of-range start silently, so range checks live at the API edge).

  Returns:
    [B, S, ...] with the chunk written.
  """
  def one(buf, x, off):
    start = (off,) + (0,) * (buf.ndim - 1)
    return jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), start)
  return jax.vmap(one)(buffer, chunk, offsets)


def after(output: jax.Array, *arrays: jax.Array) -> tuple[jax.Array, ...]:
  """`arrays` unchanged, but computed only once `output` is.

  Every layer reads the old cache and the pass then writes it. Without a
  data dependence from the last read to the write, XLA cannot prove the
  write comes last and copies the whole cache (twice, on CPU) to keep the
  old values readable, on every decode step. Adding min(|x|, 0), which is
  0 for any non-NaN x, of one element of the pass's output orders the
  write after every read, so the cache is updated in place.
  (`lax.optimization_barrier` does not survive to XLA's copy insertion.)
  """
  zero = jnp.minimum(jnp.abs(output.reshape(-1)[0]), 0)
  return tuple(a + zero.astype(a.dtype) for a in arrays)
