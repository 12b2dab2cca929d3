"""quantize="gguf" on the real offline Qwen files (fetched on first use).

The 0.5B file holds all four kept formats (Q5_0, Q8_0, Q6_K, Q4_K), the
1.5B Q4_K and Q6_K. Every tensor of the 0.5B file, and the first three
under 32 MB of each type of the 1.5B's, is repacked and dequantised by
XLA, and compared bit for bit with `gguf.quants.dequantize` (the fp32
loader's dequantisation); the 0.5B's logits on a prompt are compared with
the fp32-dequantised model's.
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import weights
from specjax.checkpoints import gguf as gguf_lib
from specjax.checkpoints import gguf_blocks
from specjax.checkpoints.gguf_reader import GGUFFile
from specjax.models import quantized

pytestmark = pytest.mark.real_models

_dequantize = jax.jit(quantized.dequantize)


# The 0.5B file holds all four formats: every tensor is checked. The 1.5B
# holds two of them (Q4_K, Q6_K) at other widths: its first layers' tensors
# of each type are (every tensor took four minutes of the real-model step;
# its [151936, 1536] embedding and output, a minute: the 0.5B's have those
# rows).
@pytest.mark.parametrize("name, per_type", [
    ("qwen2.5-coder-0.5b-instruct", None),
    ("qwen2.5-coder-1.5b-instruct", 3)])
def test_every_block_tensor_dequantises_bit_for_bit(name, per_type):
  reader = GGUFFile(weights.fetch(name))
  seen = {}
  for t in reader.tensors:
    if t.tensor_type not in gguf_blocks.SUPPORTED:
      continue
    kind = t.tensor_type.name
    if per_type is not None and (seen.get(kind, 0) >= per_type
                                 or t.data.nbytes > 32 << 20):
      continue
    seen[kind] = seen.get(kind, 0) + 1
    w = gguf_blocks.from_blocks(t.data, t.tensor_type, t.name, (1, 1))
    got = np.asarray(_dequantize(jax.tree.map(jnp.asarray, w)))
    want = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.array_equal(got.view(np.uint32),
                          want.reshape(got.shape).view(np.uint32)), t.name
    assert w.nbytes * 144 <= 148 * t.data.nbytes, t.name  # Q4_K: 148 / 144
  assert set(seen) >= {"Q4_K", "Q6_K"}


def test_half_b_logits_from_its_own_blocks():
  path = weights.fetch("qwen2.5-coder-0.5b-instruct")
  kept = gguf_lib.load_gguf(path, progress=False, quantize="gguf")
  assert kept.quantization == "q4_k+q5_0+q6_k+q8_0"
  file_bytes = sum(t.data.nbytes for t in GGUFFile(path).tensors)
  assert kept.weight_bytes_per_token <= 1.5 * file_bytes
  tokens = jnp.array([[151644, 872, 198, 750, 3974, 10231, 1140, 982]])
  run = jax.jit(lambda m, t: m(t, m.init_cache(1, 8),
                               cache_is_empty=True)[0].logits)
  got = np.asarray(run(kept, tokens))
  del kept
  dense = gguf_lib.load_gguf(path, progress=False)
  want = np.asarray(run(dense, tokens))
  # Same weights, same products; the dots sum 896 / 4864 terms in another
  # order: float32 rounding, ~1e-5 of the logits' scale.
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=2e-5 * np.abs(want).max())
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
