"""The single-file specjax checkpoint (`specjax.checkpoints.native`)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from specjax.checkpoints import native
from specjax.models import init_random
from specjax.models import ModelConfig
from specjax.models import RopeScaling
from specjax.models.config import flatten

CONFIGS = {
    "llama": ModelConfig(
        arch="llama", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
    "qwen2": ModelConfig(
        arch="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8,
        qkv_bias=True, tie_embeddings=True),
    "mistral": ModelConfig(
        arch="mistral", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
        sliding_window=16),
}


def model(arch="llama", dtype=jnp.float32, seed=0):
  return init_random(CONFIGS[arch], jax.random.key(seed), dtype)


def params_equal(a, b):
  a, b = flatten(a), flatten(b)
  return a.keys() == b.keys() and all(
      a[k].dtype == b[k].dtype
      and np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def rewrite_header(src, dst, edit):
  """Copies the file `src` to `dst` with `edit(header_dict)` applied."""
  data = src.read_bytes()
  length = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + length])
  edit(header)
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  dst.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + length:])


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_is_exact(tmp_path, arch, dtype):
  m = model(arch, dtype)
  path = tmp_path / "m.safetensors"
  native.save(m, path)
  assert native.is_checkpoint(path)
  loaded = native.load(path)
  assert loaded.config == m.config
  assert params_equal(loaded.params, m.params)
  assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


MOE = ModelConfig(
    arch="mixtral", vocab_size=96, hidden_size=64, intermediate_size=32,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, router_weights_float32=True)


@pytest.mark.parametrize("config, spec", [
    (CONFIGS["llama"], "int4:g16"), (CONFIGS["qwen2"], "int8"),
    (MOE, "int4:g32:sym")])
def test_quantized_round_trip_is_exact(tmp_path, config, spec):
  """Packed arrays and formats come back as saved (a mixture of experts'
  stacks too), with the format version 2."""
  m = init_random(config, jax.random.key(0)).quantize(spec)
  path = tmp_path / "q.safetensors"
  native.save(m, path)
  with safe_open(str(path), framework="numpy") as f:
    assert f.metadata()["version"] == "2"
  loaded = native.load(path)
  assert loaded.quantization == m.quantization
  want, got = flatten(m.params), flatten(loaded.params)
  assert want.keys() == got.keys()
  for name, w in want.items():
    assert jax.tree.structure(got[name]) == jax.tree.structure(w), name
    for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(w)):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  cast = native.load(path, jnp.bfloat16)
  assert cast.params["layers_0"]["q"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="not sharded"):
    native.load(path, mesh=object())


def test_file_is_standard_safetensors(tmp_path):
  m = model("qwen2")
  path = tmp_path / "m.safetensors"
  native.save(m, path)
  with safe_open(str(path), framework="numpy") as f:  # the reference reader
    assert json.loads(f.metadata()["config"]) == m.config.to_dict()
    tensors = {name: f.get_tensor(name) for name in f.keys()}
  want = flatten(m.params)
  assert tensors.keys() == want.keys()
  for name, x in want.items():
    np.testing.assert_array_equal(tensors[name], np.asarray(x))


def test_load_casts_and_overwrites(tmp_path):
  path = tmp_path / "m.safetensors"
  native.save(model(seed=1), path)
  m = model(seed=2)
  native.save(m, path)  # replaces the first
  cast = native.load(path, jnp.bfloat16)
  assert params_equal(cast.params,
                      jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                   m.params))


def test_reads_in_many_pieces(tmp_path, monkeypatch):
  m = model("mistral")
  path = tmp_path / "m.safetensors"
  native.save(m, path)
  # Pieces that split float32 elements and tensors at odd byte offsets.
  monkeypatch.setattr(native, "_CHUNK", 1001)
  monkeypatch.setattr(native, "_READERS", 3)
  assert params_equal(native.load(path).params, m.params)


def test_errors_name_the_problem(tmp_path):
  m = model()
  good = tmp_path / "good.safetensors"
  native.save(m, good)
  bad = tmp_path / "bad.safetensors"

  with pytest.raises(FileNotFoundError, match="does not exist"):
    native.load(tmp_path / "absent.safetensors")

  save_file({"model.embed_tokens.weight": np.zeros((4, 2), np.float32)},
            str(bad))
  assert not native.is_checkpoint(bad)
  with pytest.raises(ValueError, match="not a specjax checkpoint"):
    native.load(bad)

  bad.write_bytes(good.read_bytes()[:-100])
  assert not native.is_checkpoint(bad)
  with pytest.raises(ValueError, match="truncated"):
    native.load(bad)

  bad.write_bytes(b"\x00" * 4)
  with pytest.raises(ValueError, match="too short"):
    native.load(bad)

  def set_meta(key, value):
    return lambda h: h["__metadata__"].update({key: value})

  rewrite_header(good, bad, set_meta("version", "99"))
  with pytest.raises(ValueError, match="version 99"):
    native.load(bad)
  rewrite_header(good, bad, set_meta("config", "{not json"))
  with pytest.raises(ValueError, match="corrupt specjax metadata"):
    native.load(bad)
  rewrite_header(good, bad, set_meta("config", json.dumps(
      {**m.config.to_dict(), "arch": "gpt2"})))
  with pytest.raises(ValueError, match="invalid config.*gpt2"):
    native.load(bad)
  rewrite_header(good, bad, set_meta("config", json.dumps(
      {**m.config.to_dict(), "num_layers": 3})))
  with pytest.raises(ValueError, match=r"missing tensors \['layers_2/"):
    native.load(bad)
  rewrite_header(good, bad, set_meta("config", json.dumps(
      {**m.config.to_dict(), "tie_embeddings": True})))
  with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head'\]"):
    native.load(bad)

  def swap_shape(h):
    h["layers_0/k"]["shape"] = h["layers_0/k"]["shape"][::-1]
  rewrite_header(good, bad, swap_shape)
  with pytest.raises(ValueError, match="'layers_0/k' .* has shape"):
    native.load(bad)
