"""Cached decoding equals one full forward; parameter layout checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models
from specjax import testing

_CONFIGS = {
    "llama": testing.TINY_TARGET,
    "qwen2_tied": testing.TINY_TARGET.replace(arch="qwen2", qkv_bias=True,
                                              tie_embeddings=True),
    "mistral_window": testing.TINY_TARGET.replace(arch="mistral",
                                                  sliding_window=3),
}


def _full_logits(model, tokens):
  """Reference: one forward of whole sequences from an empty cache."""
  out, _ = model(tokens, model.init_cache(tokens.shape[0], 32))
  return np.asarray(out.logits)


@pytest.fixture(params=sorted(_CONFIGS))
def model(request):
  m = models.init_random(_CONFIGS[request.param], jax.random.key(3))
  if "q_bias" in m.params["layers_0"]:  # non-zero biases so they matter
    m = m.replace(params=jax.tree.map_with_path(
        lambda p, x: x + 0.1 if "bias" in jax.tree_util.keystr(p) else x,
        m.params))
  return testing.Jitted(m)


def _tokens(batch, length, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, 128, (batch, length)), jnp.int32)


def test_prefill_then_one_token_at_a_time(model):
  tokens = _tokens(2, 12)
  full = _full_logits(model, tokens)
  lengths = jnp.array([5, 3])
  last, cache = model.prefill(tokens[:, :8], lengths, model.init_cache(2, 32))
  np.testing.assert_allclose(last, full[[0, 1], [4, 2]], atol=1e-5)
  # Continue each row from its own length with the row's own next tokens.
  pos = np.array(lengths)
  for _ in range(6):
    step = jnp.asarray(np.asarray(tokens)[[0, 1], pos])[:, None]
    out, cache = model(step, cache)
    np.testing.assert_allclose(out.logits[:, 0], full[[0, 1], pos], atol=1e-5)
    pos += 1
  np.testing.assert_array_equal(cache.lengths, pos)


def test_chunks_at_per_row_offsets(model):
  tokens = _tokens(3, 16, seed=1)
  full = _full_logits(model, tokens)
  lengths = jnp.array([2, 5, 7])
  _, cache = model.prefill(tokens[:, :8], lengths, model.init_cache(3, 32))
  pos = np.array(lengths)
  for _ in range(2):
    idx = pos[:, None] + np.arange(3)[None]
    chunk = jnp.asarray(np.take_along_axis(np.asarray(tokens), idx, 1))
    out, cache = model(chunk, cache)
    want = np.take_along_axis(full, idx[..., None], 1)
    np.testing.assert_allclose(out.logits, want, atol=1e-5)
    # Roll back one position per row: the stale slot must not be read.
    pos += 2
    cache = cache.rollback(jnp.asarray(pos))


def test_check_params_names_missing_and_misshapen():
  m = models.init_random(testing.TINY_DRAFT, jax.random.key(0))
  params = dict(m.params)
  del params["final_norm"]
  params["embed"] = params["embed"][:, :5]
  with pytest.raises(ValueError, match="missing tensor 'final_norm'") as e:
    models.check_params(testing.TINY_DRAFT, params)
  assert "'embed' has shape (128, 5)" in str(e.value)


def test_unknown_architecture():
  with pytest.raises(ValueError, match="Unknown architecture 'gpt2'"):
    testing.TINY_DRAFT.replace(arch="gpt2")


# The default suite keeps a chunk edge and the widest last piece; the
# other two run with the slow tests (each compiles its own prefill).
@pytest.mark.parametrize("longest", [
    128, pytest.param(140, marks=pytest.mark.slow),
    pytest.param(160, marks=pytest.mark.slow), 170])
def test_chunked_prefill_equals_one_pass(longest):
  # The longest prompt ends on a chunk edge, or leaves a rest of 12, 32 or
  # 42 tokens for the last piece (16, 32 or 64 tokens wide).
  target, _ = testing.tiny_pair(seed=5)
  rng = np.random.default_rng(0)
  lengths = jnp.array([longest, 70, 5, 64], jnp.int32)
  tokens = jnp.asarray(rng.integers(0, target.vocab_size, (4, 192)),
                       jnp.int32)
  prefill = jax.jit(target.prefill, static_argnames="chunk")
  one, one_cache = prefill(tokens, lengths, target.init_cache(4, 256),
                           chunk=None)
  chunked, cache = prefill(tokens, lengths, target.init_cache(4, 256),
                           chunk=64)
  np.testing.assert_allclose(chunked, one, atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, lengths)
  for b, n in enumerate(np.asarray(lengths)):
    np.testing.assert_allclose(cache.k[:, b, :n], one_cache.k[:, b, :n],
                               atol=1e-5)
    np.testing.assert_allclose(cache.v[:, b, :n], one_cache.v[:, b, :n],
                               atol=1e-5)
