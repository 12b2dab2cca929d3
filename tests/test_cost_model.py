"""The cost model (`specjax.policies.costs`), its measured tables
(`specjax.tuning.cost`) and their predictions."""

from __future__ import annotations

import itertools
import json
import types

import jax
import numpy as np
import pytest

from specjax import metrics
from specjax import models
from specjax import policies
from specjax import testing
from specjax.models.decoder import prefill_passes
from specjax.policies.costs import expected_steps
from specjax.policies.costs import expected_tokens
from specjax.policies.costs import ForwardCosts
from specjax.tuning import cost


def test_expected_tokens_by_hand():
  assert expected_tokens([], 0) == 1.0
  # 1 + 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2
  assert expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(2.44)
  assert expected_tokens([0.9, 0.5, 0.2], 1) == pytest.approx(1.9)
  with pytest.raises(ValueError, match="Need 4 acceptance values"):
    expected_tokens([0.9], 4)


def test_prediction_reduces_to_leviathan():
  # Verify costs one forward, constant α: Leviathan et al.'s formula.
  alpha, gamma, c = 0.8, 4, 0.25
  target = ForwardCosts(1, {1: 100.0, 5: 100.0})
  draft = ForwardCosts(1, {1: 100.0 * c})
  spec = policies.StepCosts.for_fixed(gamma, target, draft).tokens_per_s(
      [alpha] * gamma, gamma, batch=target.batch)
  ar = policies.StepCosts.for_fixed(0, target).tokens_per_s(
      [], 0, batch=target.batch)
  assert ar == pytest.approx(10.0)
  assert spec / ar == pytest.approx(metrics.predicted_speedup(alpha, gamma,
                                                              c))


def test_drafting_pays_a_two_token_first_pass():
  # γ drafts: the two-token catch-up pass, then γ - 1 one-token forwards.
  draft = ForwardCosts(1, {1: 10.0, 2: 14.0})
  assert [draft.drafting_ms(g) for g in range(4)] == [0.0, 14.0, 24.0, 34.0]
  # Measured at T = 1 only, the first pass is priced as one forward.
  assert ForwardCosts(1, {1: 10.0}).drafting_ms(3) == 30.0
  target = ForwardCosts(1, {1: 100.0, 4: 130.0})
  tps = policies.StepCosts.for_fixed(3, target, draft).tokens_per_s(
      [1.0] * 3, 3, batch=target.batch)
  assert tps == pytest.approx(4 / ((130.0 + 34.0) / 1e3))


def test_prediction_uses_measured_verify_cost_and_free_drafting():
  target = ForwardCosts(2, {1: 100.0, 3: 120.0, 5: 160.0})
  assert target.at(4) == pytest.approx(140.0)  # linear between 3 and 5
  with pytest.raises(ValueError, match="outside the measured range"):
    target.at(9)
  # Zero-cost drafter (prompt lookup), B = 2 rows, γ = 4, all accepted.
  tps = policies.StepCosts.for_fixed(4, target).tokens_per_s(
      [1.0] * 4, 4, batch=target.batch)
  assert tps == pytest.approx(2 * 5 / 0.160)


def _steps_by_enumeration(acceptance, gamma, tokens, batch):
  """E[max over `batch` rows of the steps to emit `tokens`], by listing
  every joint outcome of the rows' steps (small cases only)."""
  survive = np.cumprod([1.0] + list(acceptance[:gamma]))
  emit = {i + 1: survive[i] - (survive[i + 1] if i < gamma else 0.0)
          for i in range(gamma + 1)}

  def finish(emitted):  # {steps: probability} for one row from `emitted`
    if emitted >= tokens:
      return {0: 1.0}
    out = {}
    for tau, p in emit.items():
      for s, q in finish(emitted + tau).items():
        out[s + 1] = out.get(s + 1, 0.0) + p * q
    return out

  row = finish(0)
  return sum(np.prod([p for _, p in outcome]) * max(s for s, _ in outcome)
             for outcome in itertools.product(row.items(), repeat=batch))


@pytest.mark.parametrize("acceptance,gamma,tokens,batch", [
    ([0.5], 1, 2, 1), ([0.5], 1, 2, 2), ([0.6, 0.5], 2, 3, 2),
    ([0.9, 0.7, 0.4], 3, 7, 3), ([0.3, 0.8], 2, 5, 4)])
def test_expected_steps_match_enumeration(acceptance, gamma, tokens, batch):
  expected = _steps_by_enumeration(acceptance, gamma, tokens, batch)
  assert expected_steps(acceptance, gamma, tokens,
                             batch) == pytest.approx(expected, rel=1e-9)


def test_expected_steps_by_hand():
  # γ = 1, a = 0.5, 2 tokens: one step (p 0.5) or two; two rows end
  # together after one step with p 0.25.
  assert expected_steps([0.5], 1, 2) == pytest.approx(1.5)
  assert expected_steps([0.5], 1, 2, batch=2) == pytest.approx(1.75)
  assert expected_steps([], 0, 32, batch=16) == 32.0  # plain steps
  assert expected_steps([1.0] * 4, 4, 32, batch=16) == 7.0  # ⌈32/5⌉
  with pytest.raises(ValueError, match="tokens and batch must be >= 1"):
    expected_steps([0.5], 1, 0)


def test_prediction_for_a_batch_waits_for_its_slowest_row():
  target = ForwardCosts(16, {1: 100.0, 5: 200.0})
  steady = policies.StepCosts.for_fixed(4, target).tokens_per_s(
      [0.9] * 4, 4, batch=target.batch)
  finite = policies.StepCosts.for_fixed(4, target).tokens_per_s(
      [0.9] * 4, 4, batch=target.batch, tokens=32)
  steps = expected_steps([0.9] * 4, 4, 32, batch=16)
  assert finite == pytest.approx(16 * 32 / (steps * 0.2))
  assert steps > 32 / expected_tokens([0.9] * 4, 4) and finite < steady
  # Plain steps: every row ends after `tokens` steps, as in the steady state.
  assert policies.StepCosts.for_fixed(0, target).tokens_per_s(
      [], 0, batch=target.batch, tokens=32) == (
      pytest.approx(policies.StepCosts.for_fixed(0, target).tokens_per_s(
      [], 0, batch=target.batch)))


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_measure_caches_per_machine_and_shape(tmp_path):
  target, _ = testing.tiny_pair()
  first = cost.measure(target, batch=2, chunks=(1, 3), cache_size=64,
                       prompt_tokens=8, repeats=2, cache_dir=tmp_path)
  assert first.source == "measured" and set(first.forward_ms) == {1, 3}
  again = cost.measure(target, batch=2, chunks=(1, 3), cache_size=64,
                       prompt_tokens=8, repeats=2, cache_dir=tmp_path)
  assert again.source == "cache" and again.forward_ms == first.forward_ms
  other = cost.measure(target, batch=1, chunks=(1, 3), cache_size=64,
                       prompt_tokens=8, repeats=2, cache_dir=tmp_path)
  assert other.source == "measured"
  path = tmp_path / "tuning" / "cost.json"
  path.write_text("{broken")
  with pytest.warns(RuntimeWarning, match="corrupt tuning cache"):
    assert cost.measure(target, batch=2, chunks=(1, 3), cache_size=64,
                        prompt_tokens=8, repeats=2,
                        cache_dir=tmp_path).source == "measured"


class _Timings:
  """Stands in for `hardware.looped_ms` and `forward_step`: each timing
  returns the next scripted pass ({T: ms}) for the chunks it is asked to
  time, and counts the timings."""

  def __init__(self, monkeypatch, *passes):
    self.passes = list(passes)
    self.calls = []
    monkeypatch.setattr(cost, "forward_step", lambda *a: lambda n=1: None)
    monkeypatch.setattr(cost.hardware, "looped_ms", self)
    monkeypatch.setattr(cost, "_DUE", {})  # as in a new process

  def __call__(self, steps, repeats):
    del repeats
    self.calls.append(sorted(steps))
    times = self.passes.pop(0)
    return {t: float(times[t]) for t in steps}


_KW = dict(batch=1, chunks=(1, 3), cache_size=64, prompt_tokens=8)


def _due_now():
  """Makes every table due, as once `cost._DUE`'s times have passed."""
  cost._DUE.update(dict.fromkeys(cost._DUE, 0.0))


def test_a_new_table_takes_a_third_pass_when_two_disagree(tmp_path,
                                                          monkeypatch):
  target, _ = testing.tiny_pair()
  agree = _Timings(monkeypatch, {1: 100, 3: 110}, {1: 104, 3: 112})
  costs = cost.measure(target, cache_dir=tmp_path / "a", **_KW)
  assert len(agree.calls) == 2 and costs.source == "measured"
  assert costs.forward_ms == {1: 102, 3: 111}
  # 110 and 120 at T = 3 are 9% apart (more than AGREE): a third pass, and
  # the mean of the three.
  split = _Timings(monkeypatch, {1: 100, 3: 110}, {1: 100, 3: 120},
                   {1: 103, 3: 112})
  costs = cost.measure(target, cache_dir=tmp_path / "b", **_KW)
  assert len(split.calls) == 3 and costs.forward_ms == {1: 101, 3: 114}
  (entry,) = json.loads((tmp_path / "b" / "tuning" / "cost.json")
                        .read_text()).values()
  assert entry["forward_ms"] == {"1": 101, "3": 114}
  assert len(entry["passes"]) == 3


def test_a_two_state_machine_is_priced_by_its_mean(tmp_path, monkeypatch):
  """Machine B at B = 1: the one-token forward is 141 ms a third of the
  time and 196 ms otherwise, the three-token one 183 and 206 ms. A table
  taken in the fast state puts t(3)/t(1) at 1.30; passes due a minute
  apart, one in three fast, bring it to the mean over time, and a pass
  in the other state (39% apart at T = 1) is no drift."""
  target, _ = testing.tiny_pair()
  kw = dict(_KW, cache_dir=tmp_path)
  fast, slow = {1: 141, 3: 183}, {1: 196, 3: 206}
  timings = _Timings(monkeypatch, fast, fast)
  young = cost.measure(target, **kw)
  assert young.forward_ms == fast and len(timings.calls) == 2
  # While the table is young, the next pass is due after RECHECK_MIN_S,
  # not RECHECK times a pass (it reads nothing before then).
  (key,) = cost._DUE
  assert cost._DUE[key] == pytest.approx(
      cost.time.monotonic() + cost.RECHECK_MIN_S, abs=5.0)
  assert cost.measure(target, **kw).source == "cache"
  timings.passes = [slow, fast, slow, slow, fast, slow, slow, fast]
  for _ in range(8):
    _due_now()
    costs = cost.measure(target, **kw)
  assert len(timings.calls) == 10
  # The last PASSES passes: three fast, five slow.
  mean = {t: (3 * fast[t] + 5 * slow[t]) / 8 for t in fast}
  assert costs.forward_ms == pytest.approx(mean)
  assert costs.at(3) / costs.at(1) == pytest.approx(1.13, abs=0.01)


def test_a_full_table_that_agrees_is_timed_in_proportion(tmp_path,
                                                         monkeypatch):
  """Once a table has PASSES passes, a pass that agrees with it makes the
  next due after RECHECK times its calls' time (5 repeats of 2.0 + 2.2
  s); one that does not, after RECHECK_MIN_S. A pass moves the table by
  its difference over PASSES."""
  target, _ = testing.tiny_pair()
  kw = dict(_KW, cache_dir=tmp_path)
  good, slow = {1: 2000, 3: 2200}, {1: 2160, 3: 2376}
  timings = _Timings(monkeypatch, *[good] * cost.PASSES)
  cost.measure(target, **kw)
  for _ in range(cost.PASSES - 2):
    _due_now()
    cost.measure(target, **kw)
  (key,) = cost._DUE
  assert len(timings.calls) == cost.PASSES
  assert cost._DUE[key] == pytest.approx(
      cost.time.monotonic() + cost.RECHECK * 5 * 4.2, abs=5.0)
  _due_now()
  timings.passes = [slow]  # 8% dear: disagrees
  moved = cost.measure(target, **kw)
  assert moved.forward_ms == pytest.approx(
      {t: good[t] + (slow[t] - good[t]) / cost.PASSES for t in good})
  assert cost._DUE[key] == pytest.approx(
      cost.time.monotonic() + cost.RECHECK_MIN_S, abs=5.0)


def test_a_cached_cost_that_drifted_is_measured_again(tmp_path,
                                                      monkeypatch):
  """A table whose times no longer hold (a 1000x slower machine) is timed
  at its first read in a process, every chunk, and measured anew;
  `check=False` trusts it; within DRIFT, that pass joins the table."""
  target, _ = testing.tiny_pair()
  kw = dict(_KW, cache_dir=tmp_path)
  true = {1: 100, 3: 110}
  _Timings(monkeypatch, true, true)
  cost.measure(target, **kw)
  slow = {1: 100_000, 3: 110_000}
  timings = _Timings(monkeypatch, slow, slow, slow)  # a new process
  assert cost.measure(target, check=False, **kw).forward_ms == true
  assert timings.calls == []
  again = cost.measure(target, **kw)
  assert timings.calls == [[1, 3]] * 2 and again.forward_ms == slow
  timings = _Timings(monkeypatch, {1: 130_000, 3: 99_000})
  kept = cost.measure(target, **kw)
  assert timings.calls == [[1, 3]]
  assert kept.forward_ms == pytest.approx({1: 110_000, 3: 319_000 / 3})


def test_a_table_written_before_passes_were_kept_is_read(tmp_path,
                                                         monkeypatch):
  target, _ = testing.tiny_pair()
  kw = dict(_KW, cache_dir=tmp_path)
  _Timings(monkeypatch, {1: 100, 3: 110}, {1: 100, 3: 110})
  cost.measure(target, **kw)
  path = tmp_path / "tuning" / "cost.json"
  entries = json.loads(path.read_text())
  for entry in entries.values():
    del entry["passes"]
  path.write_text(json.dumps(entries))
  assert cost.measure(target, check=False, **kw).forward_ms == {1: 100,
                                                                 3: 110}


def test_extended_prediction_by_hand():
  # 2 rows x 3 steps, γ = 2; row 1 ran only 2 steps. Position 0 proposed in
  # 5 of 5 (row, step) pairs, position 1 in 3 (a drafter proposing fewer
  # tokens some steps): d = [1.0, 0.6]. α = 4 accepted / 8 proposed.
  stats = types.SimpleNamespace(
      accepted=np.array([[2, 0, 1], [1, 0, -1]]),
      proposed=np.array([5, 3]),
      accepted_by_position=np.array([3, 1]),
      proposed_by_position=np.array([5, 3]),
      steps=np.int32(3), draft_forwards=np.array([6, 0]))
  assert metrics.drafted_fraction(stats) == pytest.approx([1.0, 0.6])
  alpha = 0.5
  tokens = 1 + 1.0 * alpha + 0.6 * alpha ** 2
  # Component costs c = (0.25, 0): 6 forwards over 3 steps = 2 per step.
  want = tokens / (0.25 * 2 + 1.2)
  got = metrics.predicted_speedup_extended(stats, [0.25, 0.0],
                                           verify_ratio=1.2)
  assert got == pytest.approx(want)
  # Always drafting γ with one model component: Leviathan with r.
  full = types.SimpleNamespace(
      accepted=np.array([[1, 2]]), proposed=np.array([4]),
      accepted_by_position=np.array([2, 1]),
      proposed_by_position=np.array([2, 2]), steps=np.int32(2),
      draft_forwards=np.array([4]))
  assert metrics.predicted_speedup_extended(full, [0.3], 1.1) == (
      pytest.approx(metrics.predicted_speedup(0.75, 2, 0.3, 1.1)))


def test_a_pass_of_a_mixture_of_experts_reads_the_union_of_its_experts():
  """E[distinct experts] of rows choosing k of X at random, against
  enumeration; the roofline then prices a longer verification pass of a
  mixture of experts by the experts it wakes, a dense one by its weights
  once."""
  x, k = 5, 2
  geometry = models.CostGeometry(weight_bytes=100.0, num_experts=x,
                                 experts_per_token=k, expert_bytes=10.0)
  subsets = list(itertools.combinations(range(x), k))
  for rows in (1, 2, 3):
    union = [len(set().union(*pick))
             for pick in itertools.product(subsets, repeat=rows)]
    assert geometry.distinct_experts(rows) == pytest.approx(np.mean(union))
  assert geometry.bytes_read(1) == 100.0
  assert geometry.bytes_read(3) == pytest.approx(
      100.0 + 10.0 * (np.mean(union) - k))
  assert geometry.bytes_read(10_000) == pytest.approx(100.0 + 10.0 * (x - k))
  dense = models.CostGeometry(weight_bytes=100.0)
  assert dense.bytes_read(1) == dense.bytes_read(9) == 100.0
  # A tiny Mixtral (8 experts, top 2): its k active experts per token are
  # its weight_bytes; on a memory-bound roofline its 9-token pass costs
  # the 9 rows' union of experts, a dense model's the same as one token.
  model = models.init_random(models.ModelConfig(
      arch="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32,
      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
      num_experts_per_tok=2), jax.random.key(0))
  g = model.cost_geometry()
  one = sum(w.size * w.dtype.itemsize for path, w in jax.tree_util.
            tree_leaves_with_path(model.params)
            if "experts_" in jax.tree_util.keystr(path)) / 8
  assert g.expert_bytes == pytest.approx(one)
  roofline = policies.costs.Roofline(bandwidth=1e9, flops=1e30,
                                     overhead_ms=0.0)
  for m, more in ((model, True), (testing.tiny_pair()[0], False)):
    ms = roofline.forward(m, batch=1, chunks=(1, 9), cache_size=8).forward_ms
    geo = m.cost_geometry()
    kv = geo.kv_bytes_per_slot * 8
    assert ms[9] / ms[1] == pytest.approx(
        (geo.bytes_read(9) + kv) / (geo.bytes_read(1) + kv))
    assert (ms[9] > ms[1]) == more


def test_a_draft_prefill_is_priced_at_the_passes_the_decoder_runs():
  # `Decoder.prefill` runs a 256-wide buffer up to its longest prompt:
  # 150 tokens are two chunks of 64 and a piece of 32 (the rest, 22, fits
  # 32 and not 16), not the buffer's four chunks; 128 end on a chunk edge.
  assert prefill_passes(150, 256, 512) == [64, 64, 32]
  assert prefill_passes(128, 256, 512) == [64, 64]
  assert prefill_passes(10, 256, 512) == [16]
  assert prefill_passes(48, 48, 512) == [48]  # one pass: not chunked
  with pytest.raises(ValueError, match="longest"):
    prefill_passes(300, 256, 512)
  # Compute-bound, no overhead: a pass costs its rows, so the prompt of
  # 150 costs 160 rows of the buffer's 256.
  roofline = policies.costs.Roofline(bandwidth=1e30, flops=1e9,
                                     overhead_ms=0.0)
  target = testing.tiny_pair()[0]
  price = lambda **kw: roofline.prefill_ms(target, batch=2, width=256,
                                           cache_size=512, **kw)
  assert price(longest=150) == pytest.approx(price() * 160 / 256)
