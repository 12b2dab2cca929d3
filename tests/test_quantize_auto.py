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
from experiments import learned
from experiments import pair as pair_lib
from specjax import registry
from specjax.cpu import kernels
from specjax.cpu import plans
from specjax.cpu import quantize as tuning
from specjax.models import MatmulPlan
from specjax.models.matmul import LayerPick

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
def test_measures_once_then_prices_each_workload(gguf_file, tmp_path):
  cache = tmp_path / "cache"
  first = _auto(gguf_file, cache)
  assert first.source == "measured"
  # tune_rows (1, 3): speculation at γ = 2, after 64-row prefill chunks.
  assert all(set(t) == {"3", "64"} for t in first.model_ms.values())
  # The head: each prompt's last position, then every verified row.
  assert all(set(t) == {"1", "3"} for t in first.head_ms.values())
  assert first.quantize == ("gguf" if first.call_ms["gguf"]
                            < first.call_ms["float"] else None)
  second = _auto(gguf_file, cache)
  assert (second.source, second.quantize) == ("cache", first.quantize)
  # A workload of new rows measures those only; the cached rows stay.
  wide = tuning.Workload.decoding(gamma=2, width=8)
  third = _auto(gguf_file, cache, workload=wide)
  assert third.source == "measured"
  assert third.model_ms["gguf"]["64"] == first.model_ms["gguf"]["64"]
  # The loader obeys the cached timings, whichever way they point.
  path = tuning.cache_file(cache)
  for fast, quantization in (("float", None), ("gguf", "q8_0")):
    entries = json.loads(path.read_text())
    for part in ("model_ms", "head_ms"):
      for name, ms in entries[first.key][part].items():
        entries[first.key][part][name] = {
            x: 1.0 if name == fast else 2.0 for x in ms}
    path.write_text(json.dumps(entries))
    model, _ = registry.load_pretrained(gguf_file, quantize="auto",
                                        cache_dir=cache, tune_rows=(1, 3),
                                        progress=False)
    assert model.quantization == quantization


def _choose(config, ms, workload, cache):
  return tuning.choose(config, lambda: None, types=str(ms),
                       float_plan=tuning.KERNEL_PLAN, workload=workload,
                       cache_dir=cache)


def _inject(monkeypatch, ms, head_ms):
  """`_measure` returns these costs: {candidate: {str(X): ms}}."""
  monkeypatch.setattr(tuning, "_measure", lambda *a: {
      n: ({str(x): ms[n][str(x)] for x in a[-2]},
          {str(x): head_ms[n][str(x)] for x in a[-1]}) for n in ms})


def test_the_workload_decides(gguf_file, tmp_path, monkeypatch):
  """Costs injected as a machine where the blocks win a decode step and
  lose a verification pass and a prefill chunk: `generate` keeps the
  blocks, speculation takes float weights."""
  config = registry.load_pretrained(gguf_file, matmul=None,
                                    progress=False)[0].config
  ms = {"float": {"1": 230.0, "9": 300.0, "64": 800.0},
        "gguf": {"1": 70.0, "9": 302.0, "64": 1300.0}}
  head_ms = {"float": {"1": 10.0, "9": 12.0}, "gguf": {"1": 5.0, "9": 12.0}}
  _inject(monkeypatch, ms, head_ms)
  generate = tuning.Workload.decoding(prompt_tokens=150, new_tokens=64)
  speculate = tuning.Workload.decoding(prompt_tokens=150, new_tokens=64,
                                       gamma=8)
  assert generate.passes == ((1, 64.0), (64, 2.5))
  assert generate.head_passes == ((1, 65.0),)
  assert [x for x, _ in speculate.passes] == [9, 64]
  assert [x for x, _ in speculate.head_passes] == [1, 9]
  for workload, want in ((generate, "gguf"), (speculate, None)):
    choice = _choose(config, ms, workload, tmp_path)
    assert choice.quantize == want
    assert choice.call_ms["gguf"] == pytest.approx(
        sum(n * ms["gguf"][str(x)] for x, n in workload.passes)
        + sum(n * head_ms["gguf"][str(x)] for x, n in workload.head_passes))
    assert workload.label in choice.why
  # Where the blocks also win the pass of γ + 1 rows, speculation keeps
  # them: the call, not one kind of pass, decides.
  ms["gguf"]["9"] = 150.0
  assert _choose(config, ms, speculate, tmp_path / "b").quantize == "gguf"


def test_passes_measured_by_an_earlier_run_price_the_job(gguf_file, tmp_path,
                                                         monkeypatch):
  """Costs injected as a machine where the blocks win the 9-row pass by
  less than they lose a prefill chunk: at the prior's 20.6 passes a call
  the blocks are cheaper, at the 9 passes a lookup run measured float is;
  the experiments price a job by what its last run took."""
  config = registry.load_pretrained(gguf_file, matmul=None,
                                    progress=False)[0].config
  ms = {"float": {"9": 300.0, "64": 1000.0},
        "gguf": {"9": 150.0, "64": 1800.0}}
  same = {"1": 10.0, "9": 12.0}
  _inject(monkeypatch, ms, {"float": same, "gguf": same})
  job = dict(prompt_tokens=150, new_tokens=64, gamma=8)
  prior = tuning.Workload.decoding(**job)
  measured = tuning.Workload.decoding(**job, steps=9.125)
  assert measured.passes == ((9, 9.125), (64, 2.5))
  assert measured.head_passes == ((1, 1.0), (9, 9.125))
  assert "9.1 passes of 9 rows, measured" in measured.label
  assert dict(prior.passes)[9] > 20
  assert _choose(config, ms, prior, tmp_path).quantize == "gguf"
  assert _choose(config, ms, measured, tmp_path).quantize is None
  with pytest.raises(ValueError, match="measured steps"):
    tuning.Workload.decoding(new_tokens=64, gamma=0, steps=9.0)
  with pytest.raises(ValueError, match="measured steps"):
    tuning.Workload.decoding(new_tokens=64, gamma=8, steps=65.0)

  # experiments.learned: what the last run of the same job took.
  job_config = llama_pair.get_config()
  job_config.cache_dir = str(tmp_path / "cache")
  assert learned.steps_per_call(job_config) is None
  learned.record(job_config, 9.125)
  assert learned.steps_per_call(job_config) == 9.125
  other = llama_pair.get_config("quantize=,tokens=64")  # same job, fp32
  other.cache_dir = job_config.cache_dir
  assert learned.steps_per_call(other) == 9.125
  for arg in ("temperature=0.5", "gamma=4", "drafter=model", "n=4"):
    changed = llama_pair.get_config(arg)
    changed.cache_dir = job_config.cache_dir
    assert learned.steps_per_call(changed) is None, arg


def test_a_prefill_is_priced_as_the_decoder_runs_it():
  """`Decoder.prefill`: whole chunks of 64 rows, the rest in one piece of
  16, 32 or 64 rows, and the head on each prompt's last position only."""
  for prompt, chunks in ((64, 1.0), (100, 2.0), (128, 2.0), (129, 2.25),
                         (150, 2.5), (190, 3.0)):
    work = tuning.Workload.decoding(batch=2, prompt_tokens=prompt,
                                    new_tokens=8)
    assert work.passes == ((2, 8.0), (128, chunks)), prompt
    assert work.head_passes == ((2, 9.0),)


@needs_kernel
def test_float_layers_are_priced_as_their_loop_multiplies_them(gguf_file):
  """A float model on a looping kernel plan multiplies every matrix in the
  kernel at any X (`LayerPick`), so its timed stack does too; an XLA plan
  keeps its arrays."""
  config = registry.load_pretrained(gguf_file, matmul=None,
                                    progress=False)[0].config
  layers, _ = plans.stack(config, jnp.float32, tuning.KERNEL_PLAN)
  looped = tuning._as_looped(layers, tuning.KERNEL_PLAN, jnp.float32)
  assert all(isinstance(w, LayerPick) for p in looped for w in p.values())
  xla = MatmulPlan.parse("out_in/xla")
  assert tuning._as_looped(layers, xla, jnp.float32) is layers


def test_speculative_steps_follow_the_acceptance():
  """E[steps] at acceptance a per position: N / E[τ] plus the last
  step's overshoot; a tree's width replaces γ + 1."""
  high = tuning.Workload.decoding(new_tokens=64, gamma=4, acceptance=1.0)
  assert high.passes == ((5, pytest.approx(64 / 5, abs=1)), (64, 2.0))
  low = tuning.Workload.decoding(new_tokens=64, gamma=4, acceptance=0.0)
  assert low.passes == ((5, 64.0), (64, 2.0))
  tree = tuning.Workload.decoding(batch=2, gamma=4, width=17)
  assert tree.rows == (34, 128)
  with pytest.raises(ValueError, match="gamma"):
    tuning.Workload.decoding(gamma=-1)


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
