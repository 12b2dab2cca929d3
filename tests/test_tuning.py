"""`specjax.cpu.plans`: measure once, cache, re-measure when asked."""

from __future__ import annotations

import json
import warnings

import pytest

from specjax import testing
from specjax.cpu import kernels
from specjax.cpu import plans as tuning


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.delenv("SPECJAX_MATMUL", raising=False)
  return tmp_path


def test_measures_once_then_reads_the_cache(cache):
  config = testing.TINY_TARGET
  first = tuning.tune(config, rows=(1, 3), cache_dir=cache)
  assert first.source == "measured"
  assert set(first.timings_ms) == set(tuning.candidates("float32"))
  assert first.plan.name == min(
      first.timings_ms, key=lambda n: sum(first.timings_ms[n].values()))
  second = tuning.tune(config, rows=(1, 3), cache_dir=cache)
  assert second.source == "cache" and second.plan == first.plan
  # Other rows or shapes are other keys.
  assert tuning.tune(config, rows=(1, 5), cache_dir=cache).source == (
      "measured")
  assert tuning.tune(testing.TINY_DRAFT, rows=(1, 3),
                     cache_dir=cache).source == "measured"
  entries = json.loads(tuning.cache_file(cache).read_text())
  assert len(entries) == 3
  assert all("cores=" in key and "jax=" in key for key in entries)


def test_deleting_the_cache_re_measures(cache):
  tuning.tune(testing.TINY_TARGET, cache_dir=cache)
  tuning.cache_file(cache).unlink()
  assert tuning.tune(testing.TINY_TARGET, cache_dir=cache).source == (
      "measured")


def test_a_choice_timed_another_way_is_made_again(cache, monkeypatch):
  from specjax import hardware  # pylint: disable=g-import-not-at-top
  timed = hardware.TIMED
  monkeypatch.setattr(hardware, "TIMED", "round-robin")
  assert tuning.tune(testing.TINY_TARGET, rows=(1, 3),
                     cache_dir=cache).source == "measured"
  assert tuning.tune(testing.TINY_TARGET, rows=(1, 3),
                     cache_dir=cache).source == "cache"
  monkeypatch.setattr(hardware, "TIMED", timed)
  assert tuning.tune(testing.TINY_TARGET, rows=(1, 3),
                     cache_dir=cache).source == "measured"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]",
                                     '{"k": {"plan": "sideways/xla"}}'])
def test_a_corrupt_cache_is_ignored_with_a_warning(cache, content):
  path = tuning.cache_file(cache)
  path.parent.mkdir(parents=True)
  path.write_text(content)
  with pytest.warns(RuntimeWarning, match="corrupt tuning cache"):
    result = tuning.tune(testing.TINY_TARGET, cache_dir=cache)
  assert result.source == "measured"
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # rewritten: no warning the second time
    assert tuning.tune(testing.TINY_TARGET, cache_dir=cache).source == (
        "cache")


def test_forcing_a_plan(cache, monkeypatch):
  forced = tuning.tune(testing.TINY_TARGET, matmul="out_in/xla",
                       cache_dir=cache)
  assert forced.source == "forced" and forced.plan.name == "out_in/xla"
  assert not tuning.cache_file(cache).exists()  # nothing measured
  monkeypatch.setenv("SPECJAX_MATMUL", "in_out/xla")
  assert tuning.tune(testing.TINY_TARGET, cache_dir=cache).plan.name == (
      "in_out/xla")
  monkeypatch.delenv("SPECJAX_MATMUL")
  monkeypatch.setattr(kernels, "available", lambda: False)
  assert "out_in/kernel" not in tuning.candidates("float32")
  assert "out_in/hybrid" not in tuning.candidates("float32")
  with pytest.raises(kernels.KernelError, match="not available"):
    tuning.tune(testing.TINY_TARGET, matmul="out_in/kernel", cache_dir=cache)


def test_apply_sets_the_plan(cache):
  target, _ = testing.tiny_pair()
  model, result = tuning.apply(target, "out_in/xla", cache_dir=cache)
  assert model.plan == result.plan
  assert model.params["layers_0"]["q"].shape == (64, 64)
  assert model.params["layers_0"]["k"].shape == (32, 64)  # [K*D, E]


def test_cpus_sharing_a_name_measure_apart(cache, monkeypatch):
  # Under a hypervisor Zen 1 and Zen 4 both read "AMD EPYC": a plan (or a
  # -march=native kernel) from one must not be taken for the other.
  from specjax import hardware  # pylint: disable=g-import-not-at-top

  def on(family, flags):
    info = {"model name": "AMD EPYC", "cpu family": family, "model": "1",
            "flags": flags}
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: info)
    hardware.cpu_id.cache_clear()
    return tuning.tune(testing.TINY_TARGET, rows=(1, 3), cache_dir=cache)

  try:
    assert on("23", "fma avx2").source == "measured"
    assert on("23", "fma avx2").source == "cache"
    assert on("25", "fma avx2").source == "measured"
    assert on("25", "fma avx2 avx512f").source == "measured"
    assert hardware.cpu_id() == "AMD EPYC (family 25 model 1; avx2,avx512f)"
  finally:
    hardware.cpu_id.cache_clear()  # the real CPU's, once monkeypatch undoes
  keys = json.loads(tuning.cache_file(cache).read_text())
  assert len(keys) == 3, keys


def test_settle_times_each_step_after_a_call_of_its_own(monkeypatch):
  """Two steps, each 1 ms after a call of itself and 40 ms after the
  other's (as a one-token forward after a wide one): timed round-robin,
  both come out near 40 ms; settled, near 1 ms."""
  import time  # pylint: disable=g-import-not-at-top
  from specjax import hardware  # pylint: disable=g-import-not-at-top
  monkeypatch.undo()  # the real `median_ms`, not the suite's stand-in
  last = []

  def step(name):
    def call():
      time.sleep(0.001 if last[-1:] == [name] else 0.04)
      last.append(name)
    return call

  steps = {"a": step("a"), "b": step("b")}
  assert min(hardware.median_ms(steps, 3, warmup=0).values()) > 30
  assert max(hardware.median_ms(steps, 3, warmup=0, settle=1).values()) < 20


def test_looped_ms_times_one_more_iteration_of_a_loop(monkeypatch):
  """A call of n iterations that costs 30 ms once (what XLA hoists out of
  a loop, and the dispatch) and 5 ms per iteration: timed as calls, 35 ms;
  as one more iteration, 5 ms."""
  import time  # pylint: disable=g-import-not-at-top
  from specjax import hardware  # pylint: disable=g-import-not-at-top
  monkeypatch.undo()  # the real timers, not the suite's stand-ins
  seen = []

  def step(n=1):
    seen.append(n)
    time.sleep(0.03 + 0.005 * n)

  assert hardware.median_ms({"s": step}, 3, warmup=0)["s"] > 33
  assert 4 < hardware.looped_ms({"s": step}, 3)["s"] < 8
  # Several more iterations (4 take the 20 ms a difference needs), not 1.
  assert seen[-2] == 1 and seen[-1] >= 3


def test_a_slow_moment_does_not_decide(monkeypatch):
  """`settled_ms` takes passes until two agree and keeps each step's least:
  a pass that caught the machine busy for one step is outvoted. Each pass
  times one group's steps at a time."""
  from specjax import hardware  # pylint: disable=g-import-not-at-top
  passes = iter([{"a": 3.0, "b": 2.0},   # a slow moment for "a"
                 {"a": 1.0, "b": 2.05},  # disagrees with the first
                 {"a": 1.02, "b": 2.0},  # agrees with the second
                 {"a": 9.0, "b": 9.0}])  # never reached
  calls = []

  def median_ms(steps, repeats, settle=0):
    assert settle == 1  # each step timed after a call of its own
    calls.append(sorted(steps))
    if steps.keys() == {"a"}:
      current.update(next(passes))
    return {k: current[k] for k in steps}

  current = {}
  monkeypatch.setattr(hardware, "median_ms", median_ms)
  steps = {"a": None, "b": None}
  assert hardware.settled_ms(steps, 3, group=str) == {"a": 1.0, "b": 2.0}
  assert calls == [["a"], ["b"]] * 3
  assert next(passes) == {"a": 9.0, "b": 9.0}
  # At most `max_passes`, however much they disagree; one group by default.
  monkeypatch.setattr(hardware, "median_ms",
                      lambda steps, r, settle, n=iter(range(1, 9)): {
                          k: float(next(n)) ** 2 for k in steps})
  assert hardware.settled_ms(steps, 3, max_passes=3) == {"a": 1.0, "b": 4.0}
  with pytest.raises(ValueError, match="max_passes"):
    hardware.settled_ms(steps, 3, max_passes=1)
