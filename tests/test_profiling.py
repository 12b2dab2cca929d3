"""`specjax.profiling.executed_ops`: operations counted per loop iteration."""

import jax
import jax.numpy as jnp

from specjax import profiling


def test_executed_ops_count_every_iteration_of_a_loop():
  @jax.jit
  def loop(x, n):
    # Two dependent ops an iteration that XLA cannot fold into one.
    return jax.lax.fori_loop(0, n, lambda i, y: jnp.sort(jnp.sin(y) * i), x)

  x = jnp.linspace(0.0, 1.0, 64)
  jax.block_until_ready(loop(x, 1))
  short, long = (profiling.executed_ops(lambda n=n: loop(x, n))
                 for n in (10, 30))
  # Twenty more iterations execute at least one more op each; the counts
  # are per call, not summed over the traced calls.
  assert long - short >= 20, (short, long)
  assert long < 30 * 20, long
