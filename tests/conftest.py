"""Shared fixtures: tiny random Hugging Face checkpoints on disk.

`hf_checkpoint(arch)` returns `(directory, torch_model)` for a tiny random
float32 `LlamaForCausalLM` ('llama', llama3 rope scaling), `MistralForCausalLM`
('mistral', sliding window 4, head_dim 24 != hidden / heads),
`Qwen2ForCausalLM` ('qwen2', tied embeddings, q/k/v biases) or
`Gemma3ForCausalLM` ('gemma3', see `GEMMA3_LAYER_TYPES`), saved with
`save_pretrained` as safetensors. Each is built once per session; treat the
torch model and the directory as read-only (copy them to modify).

Every parameter is redrawn, norms and biases included (transformers
initialises norms to one and biases to zero, which would hide a swapped norm
or a dropped bias), at a scale that keeps logits O(1).
"""

from __future__ import annotations

import os
import zlib

import pytest

# Tests neither read nor fill the user's persistent compilation cache
# (SPECJAX_NO_COMPILE_CACHE). Each pytest-xdist worker keeps its own, under
# the checkout's .xla_test_cache/ (one shared cache written by two workers at
# once aborted a worker once, JAX 0.10.2, in the cache write): a program that
# a later test module, or the later `-m slow` and `-m real_models` runs,
# compiles again is read from disk. SPECJAX_TEST_XLA_CACHE=0 turns it off.
# Tests of the cache set their own directory.
os.environ.setdefault("SPECJAX_NO_COMPILE_CACHE", "1")


def pytest_configure(config):
  """XLA's CPU backend at LLVM -O0 with its elemental fusion emitters, and
  a compilation cache per worker.

  Tests compile far more than they run: -O0 halves XLA's compile of a tiny
  speculative generation (backend compile 19.8 s -> 9.2 s on a 2-core
  EPYC, the same tokens, 0.02 s -> 0.07 s a call). The elemental emitters
  (`--xla_cpu_use_fusion_emitters=false`) take another third off: backend
  compile 5.6-6.1 s -> 3.1-3.7 s for the tiny pair's, 23 -> 15 ms a one-op
  program of the kind eager calls compile, and the default suite from a
  cold cache 9:46 -> 5:46 (2-core Xeon, JAX 0.10.2). Neither is what a
  user runs; every exactness test passes under both. A run of the
  real-model tests alone (`-m real_models`: 1.5B forwards, where run time
  counts) keeps the defaults. XLA reads the flags when its CPU client
  starts, after this hook.
  """
  expr = config.getoption("markexpr", "").replace(" ", "")
  real_only = "real_models" in expr and "notreal_models" not in expr
  flags = os.environ.get("XLA_FLAGS", "")
  if not real_only:
    fast = [f"--{name}={value}" for name, value in (
        ("xla_backend_optimization_level", 0),
        ("xla_cpu_use_fusion_emitters", "false")) if name not in flags]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, (flags, *fast)))
  if os.environ.get("SPECJAX_TEST_XLA_CACHE", "1") == "0":
    return
  import jax  # pylint: disable=g-import-not-at-top
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  directory = os.path.join(str(config.rootpath), ".xla_test_cache", worker)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _scripted_ms(steps, repeats, warmup=2, settle=0):
  """Stands in for `hardware.median_ms` and `looped_ms` in the default
  suite: runs each step once (so every code path still compiles and
  executes) and returns a fixed, distinct time per step name instead of
  a measurement."""
  del repeats, warmup, settle
  import jax  # pylint: disable=g-import-not-at-top
  out = {}
  for name, step in steps.items():
    jax.block_until_ready(step())
    out[name] = 1.0 + zlib.crc32(repr(name).encode()) % 1000 / 1000
  return out


@pytest.fixture(autouse=True)
def _no_timing_in_the_default_suite(request, monkeypatch):
  """The default suite times no forward: tuning steps and experiment cost
  ratios read `_scripted_ms`. Tests marked `slow` or `real_models` time
  for real, and a test may patch the timers itself."""
  if not any(request.node.get_closest_marker(m)
             for m in ("slow", "real_models")):
    from specjax import hardware  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(hardware, "median_ms", _scripted_ms)
    monkeypatch.setattr(hardware, "looped_ms", _scripted_ms)


HF_ARCHS = ("llama", "mistral", "qwen2", "gemma3")

# The tiny Gemma 3: local, local, global, local (a 3-layer pattern that does
# not divide the 4 layers), window 4 (test prompts run past it), linear rope
# scaling on the global layers only, head_dim 24 != hidden / heads,
# query_pre_attn_scalar 20 != head_dim, and a final logit soft-cap that
# bites (logits are O(1)).
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention",
                      "full_attention", "sliding_attention"]

# Small but not degenerate: grouped-query attention (4 query heads per 2 kv
# heads), two layers, a vocabulary larger than the hidden size.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5)


def tiny_hf_config(arch: str):
  """A tiny transformers config for `arch` in `HF_ARCHS`, eager attention."""
  import transformers  # pylint: disable=g-import-not-at-top
  if arch == "llama":
    # original_max_position_embeddings=32 puts rope wavelengths in all three
    # llama3 bands (kept, smoothed, scaled) for head_dim 16 and theta 1e4.
    return transformers.LlamaConfig(
        **_COMMON, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        attn_implementation="eager")
  if arch == "mistral":
    return transformers.MistralConfig(
        **_COMMON, head_dim=24, sliding_window=4, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="eager")
  if arch == "qwen2":
    return transformers.Qwen2Config(
        **_COMMON, rope_theta=1e6, tie_word_embeddings=True,
        use_sliding_window=False, attn_implementation="eager")
  if arch == "gemma3":
    common = dict(_COMMON, num_hidden_layers=len(GEMMA3_LAYER_TYPES))
    return transformers.Gemma3TextConfig(
        **common, head_dim=24, sliding_window=4,
        layer_types=GEMMA3_LAYER_TYPES, query_pre_attn_scalar=20,
        final_logit_softcapping=3.0, tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0,
                               "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": 10000.0}},
        attn_implementation="eager")
  raise ValueError(f"Unknown test architecture {arch!r}; use one of "
                   f"{HF_ARCHS}.")


def tiny_hf_model(arch: str, seed: int = 0):
  """A float32 eval-mode transformers model with every parameter random."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(
      tiny_hf_config(arch), attn_implementation="eager").to(torch.float32)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.5 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
  """Factory: arch name -> (checkpoint directory, float32 torch model)."""
  built = {}

  def make(arch: str):
    if arch not in built:
      model = tiny_hf_model(arch)
      directory = os.fspath(tmp_path_factory.mktemp(f"hf_{arch}"))
      model.save_pretrained(directory)
      built[arch] = (directory, model)
    return built[arch]

  return make


@pytest.fixture(params=HF_ARCHS)
def hf_arch(request) -> str:
  """Parametrizes a test over every tiny checkpoint architecture."""
  return request.param


@pytest.fixture(scope="module")
def pair():
  """The random tiny (target, draft) pair of `specjax.testing`, seed 0."""
  from specjax import testing  # pylint: disable=g-import-not-at-top
  return testing.tiny_pair(seed=0)


@pytest.fixture(scope="module")
def baseline(request, pair):
  """Greedy `generate` of the tiny target on the test module's PROMPTS,
  MAX_NEW tokens: the reference speculative outputs must equal."""
  from specjax import decode  # pylint: disable=g-import-not-at-top
  module = request.module
  return decode.generate(pair[0], module.PROMPTS,
                         max_new_tokens=module.MAX_NEW)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops every compiled program after each test module.

  A pytest-xdist worker otherwise keeps every program it compiled for the
  whole session (hundreds, with the tree and adaptive-γ variants); two CI
  runs lost a worker late in the suite, once in JAX's executable
  serialisation and once in XLA compilation, the two memory-hungry steps.
  """
  yield
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
