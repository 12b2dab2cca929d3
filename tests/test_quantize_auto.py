"""`quantize="auto"`: a GGUF model's own blocks or its float weights, as
measured on this machine (`specjax.cpu.quantize`), cached per machine;
float wherever the blocks cannot be the faster model."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import llama_pair
from configs import tiny_pair
from experiments import pair as pair_lib
from specjax import registry
from specjax.cpu import kernels
from specjax.cpu import quantize as tuning

import test_gguf

Q = test_gguf.Q
_TYPES = {"proj": Q.Q8_0, "embed": Q.Q8_0}

needs_kernel = pytest.mark.skipif(not kernels.available(),
                                  reason="needs the specjax CPU kernels")


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
  monkeypatch.delenv("SPECJAX_MATMUL", raising=False)
  path = tmp_path / "tiny.gguf"
  test_gguf.write_gguf(path, "qwen2", types=_TYPES)
  return path


def _auto(path, cache, **kwargs):
  return registry.auto_quantize(path, cache_dir=cache, progress=False,
                                tune_rows=(1, 3), **kwargs)


@needs_kernel
def test_measures_once_then_loads_what_the_cache_says(gguf_file, tmp_path):
  cache = tmp_path / "cache"
  first = _auto(gguf_file, cache)
  assert first.source == "measured"
  assert set(first.model_ms) == {"float", "gguf"}
  assert all(set(t) == {"1", "3"} for t in first.model_ms.values())
  faster = min(first.model_ms, key=lambda n: sum(first.model_ms[n].values()))
  assert first.quantize == ("gguf" if faster == "gguf" else None)
  second = _auto(gguf_file, cache)
  assert (second.source, second.quantize) == ("cache", first.quantize)
  # The loader obeys the cached choice, whichever way it points.
  path = tuning.cache_file(cache)
  for choice, quantization in ((None, None), ("gguf", "q8_0")):
    entries = json.loads(path.read_text())
    entries[first.key]["quantize"] = choice
    path.write_text(json.dumps(entries))
    model, _ = registry.load_pretrained(gguf_file, quantize="auto",
                                        cache_dir=cache, tune_rows=(1, 3),
                                        progress=False)
    assert model.quantization == quantization


def test_the_smaller_total_over_rows_wins(gguf_file, tmp_path, monkeypatch):
  config = registry.load_pretrained(gguf_file, matmul=None,
                                    progress=False)[0].config
  for ms, want in (({"float": {"1": 9.0, "3": 9.0},
                     "gguf": {"1": 4.0, "3": 13.0}}, "gguf"),
                   ({"float": {"1": 9.0, "3": 9.0},
                     "gguf": {"1": 4.0, "3": 15.0}}, None)):
    monkeypatch.setattr(tuning, "_measure", lambda *a, ms=ms: ms)
    choice = tuning.choose(config, lambda: None, types=str(ms),
                           float_plan=tuning.KERNEL_PLAN, rows=(1, 3),
                           cache_dir=tmp_path)
    assert (choice.source, choice.quantize) == ("measured", want)
    assert "(rows 1, 3)" in choice.why


def test_float_where_blocks_cannot_win(gguf_file, tmp_path, monkeypatch):
  not_gguf = _auto(tmp_path, tmp_path)  # a checkpoint directory
  assert (not_gguf.source, not_gguf.quantize) == ("fixed", None)
  assert "not a GGUF file" in not_gguf.why
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  assert "mesh" in _auto(gguf_file, tmp_path, mesh=mesh).why
  bf16 = _auto(gguf_file, tmp_path, dtype=jnp.bfloat16)
  assert (bf16.source, bf16.quantize) == ("fixed", None)
  monkeypatch.setattr(kernels, "available", lambda: False)
  assert "kernels are not available" in _auto(gguf_file, tmp_path).why
  assert not tuning.cache_file(tmp_path).exists()


def test_an_unkept_block_type_is_float(tmp_path):
  path = tmp_path / "q4_0.gguf"
  test_gguf.write_gguf(path, "qwen2", types={"proj": Q.Q4_0})
  choice = _auto(path, tmp_path)
  assert (choice.source, choice.quantize) == ("fixed", None)
  assert "Q4_0" in choice.why


def test_tiny_experiment_pair_stays_float():
  config = tiny_pair.get_config("tokens=4")
  config.quantize = "auto"  # random weights: no GGUF file to keep
  loaded = pair_lib.load_pair(config)
  assert loaded.quantize is None
  assert loaded.target.quantization is None


def test_the_main_job_defaults_to_auto():
  assert llama_pair.get_config().quantize == "auto"
