"""Gemma 3 beyond the shared checkpoint tests: configs, clear errors for
what specjax does not run, and speculation on the tiny Gemma pair.

Shape letters: B batch, P prompt, V vocab.

Logits and greedy generation against transformers on the tiny random
Gemma3ForCausalLM live with the other architectures
(tests/test_hf_checkpoints.py, tests/test_generate_hf.py: 'gemma3').
"""

from __future__ import annotations

import json
import shutil

import pytest

from specjax.checkpoints import convert
from specjax.checkpoints import gguf as gguf_lib
from specjax.checkpoints import hf
from specjax.models import LinearRopeScaling
from specjax.models import ModelConfig
from specjax.models import tiny
import test_gguf


def _text_config(**overrides):
  """A transformers 4 style gemma3_text config.json dict (Gemma 3 1B)."""
  config = {
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
      "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
      "num_hidden_layers": 26, "num_attention_heads": 4,
      "num_key_value_heads": 1, "head_dim": 256, "rope_theta": 1e6,
      "rope_local_base_freq": 10000.0, "sliding_window": 512,
      "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
      "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
      "final_logit_softcapping": None, "attn_logit_softcapping": None,
      "rope_scaling": None, "max_position_embeddings": 32768,
  }
  config.update(overrides)
  return config


def test_transformers_4_layout():
  c = convert.config_from_hf(_text_config())
  assert (c.arch, c.sliding_window, c.sliding_window_pattern) == (
      "gemma3", 512, 6)
  assert [i for i in range(26) if c.layer_window(i) is None] == [5, 11, 17,
                                                                 23]
  assert c.layer_rope(0) == (10000.0, None) and c.layer_rope(5) == (1e6, None)
  assert c.tie_embeddings and c.head_dim == 256 and c.num_kv_heads == 1
  assert (c.norm_plus_one, c.qk_norm, c.post_norms, c.scale_embeddings) == (
      True, True, True, True)
  assert c.activation == "gelu_tanh" and c.final_logit_softcap is None
  scaled = convert.config_from_hf(_text_config(
      rope_scaling={"rope_type": "linear", "factor": 8.0}))
  assert scaled.layer_rope(5) == (1e6, LinearRopeScaling(8.0))
  assert scaled.layer_rope(4) == (10000.0, None)


def test_config_round_trips_through_dict():
  for config in (tiny.TINY_GEMMA3_TARGET,
                 tiny.TINY_GEMMA3_TARGET.replace(
                     rope_scaling=LinearRopeScaling(8.0))):
    assert ModelConfig.from_dict(json.loads(json.dumps(
        config.to_dict()))) == config


def test_unsupported_gemma3_variants_name_the_problem():
  with pytest.raises(ValueError, match="vision_tower.*text-only Gemma 3"):
    convert.config_from_hf({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3", "text_config": _text_config(),
        "vision_config": {"model_type": "siglip_vision_model"}})
  with pytest.raises(ValueError, match="vision_tower.*Gemma3ForCausalLM"):
    convert.config_from_hf({"model_type": "gemma3",
                            "text_config": _text_config()})
  with pytest.raises(ValueError, match="attn_logit_softcapping"):
    convert.config_from_hf(_text_config(attn_logit_softcapping=50.0))
  with pytest.raises(ValueError, match="hidden_activation"):
    convert.config_from_hf(_text_config(hidden_activation="relu"))
  with pytest.raises(ValueError, match="one local:global pattern"):
    convert.config_from_hf(_text_config(
        num_hidden_layers=4, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention",
            "sliding_attention"]))
  with pytest.raises(ValueError, match="local layers with rope_type"):
    convert.config_from_hf(_text_config(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0}}))
  with pytest.raises(ValueError, match="sliding_window_pattern=3 needs"):
    tiny.TINY_GEMMA3_TARGET.replace(sliding_window=None)
  with pytest.raises(ValueError, match="Unknown activation"):
    tiny.TINY_GEMMA3_TARGET.replace(activation="relu")


@pytest.mark.slow  # builds and saves a multimodal transformers model
def test_multimodal_checkpoint_is_refused(hf_checkpoint, tmp_path):
  src, _ = hf_checkpoint("gemma3")
  shutil.copytree(src, tmp_path / "ckpt")
  path = tmp_path / "ckpt" / "config.json"
  text = json.loads(path.read_text())
  path.write_text(json.dumps({
      "architectures": ["Gemma3ForConditionalGeneration"],
      "model_type": "gemma3", "text_config": text,
      "vision_config": {"model_type": "siglip_vision_model"}}))
  with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*"
                     "vision_tower.*not supported"):
    hf.load_hf(tmp_path / "ckpt")


def _write_gemma3_gguf(path, torch_model, pattern: int) -> None:
  """Writes a transformers Gemma 3 as llama.cpp's converter would: gemma3
  names, every norm scale stored as w + 1, Q/K rows unpermuted, the
  window, pattern and linear rope scaling in the metadata."""
  import gguf  # pylint: disable=g-import-not-at-top
  c = torch_model.config
  writer = gguf.GGUFWriter(str(path), "gemma3")
  test_gguf.add_geometry(
      writer, layers=c.num_hidden_layers, context=c.max_position_embeddings,
      hidden=c.hidden_size, ffn=c.intermediate_size,
      heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
      head_dim=c.head_dim,
      rope_theta=c.rope_parameters["full_attention"]["rope_theta"],
      eps=c.rms_norm_eps)
  writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
  writer.add_rope_scaling_factor(
      c.rope_parameters["full_attention"]["factor"])
  writer.add_sliding_window(c.sliding_window)
  writer.add_sliding_window_pattern([bool((i + 1) % pattern)
                                     for i in range(c.num_hidden_layers)])
  writer.add_float32("gemma3.final_logit_softcapping",
                     c.final_logit_softcapping)
  inverse = {v: k for k, v in gguf_lib._GLOBAL_NAMES.items()}
  inverse.update({v: k for k, v in gguf_lib._GEMMA3_LAYER_NAMES.items()})
  for name, p in torch_model.state_dict().items():
    if name == "lm_head.weight":
      continue  # tied
    w = p.detach().float().numpy()
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      gname = f"blk.{i}.{inverse[rest]}"
    else:
      gname = inverse[name]
    writer.add_tensor(gname, w + 1 if name.endswith("norm.weight") else w)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_gguf_gemma3_matches_transformers(hf_checkpoint, tmp_path):
  """A tiny Gemma 3 written as a GGUF loads to transformers' logits.

  llama.cpp scales queries by head_dim ** -0.5, so the reference here uses
  query_pre_attn_scalar = head_dim (the real 270M's 256 = 256).
  """
  import copy  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  _, torch_model = hf_checkpoint("gemma3")
  torch_model = copy.deepcopy(torch_model)
  for layer in torch_model.model.layers:
    layer.self_attn.scaling = torch_model.config.head_dim ** -0.5
  path = tmp_path / "tiny-gemma3.gguf"
  _write_gemma3_gguf(path, torch_model, pattern=3)
  model = gguf_lib.load_gguf(path, progress=False)
  c = model.config
  assert (c.arch, c.sliding_window, c.sliding_window_pattern) == (
      "gemma3", 4, 3)
  assert c.rope_scaling == LinearRopeScaling(2.0)
  assert (c.query_pre_attn_scalar, c.final_logit_softcap) == (24.0, 3.0)
  assert c.tie_embeddings and "lm_head" not in model.params
  np.testing.assert_allclose(
      model.params["layers_1"]["q_norm"],
      torch_model.model.layers[1].self_attn.q_norm.weight.detach().numpy(),
      atol=1e-6)
  tokens = np.random.default_rng(0).integers(0, 128, (2, 12))
  out, _ = model(jnp.asarray(tokens, jnp.int32), model.init_cache(2, 12))
  with torch.no_grad():
    want = torch_model(torch.tensor(tokens)).logits.numpy()
  assert np.abs(np.asarray(out.logits) - want).max() <= 1e-4


# ---------------------------------------------------------------------------
# Speculation on the tiny Gemma pair (window 4, local/local/global/local):
# every prompt and generation runs past the window.

PROMPTS = [[5, 17, 99, 3, 8, 21, 40], [42, 7, 7, 9, 42, 7],
           [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 7, 8, 9]]
MAX_NEW = 20


@pytest.fixture(scope="module")
def gemma_pair():
  return tiny.gemma3_pair(seed=0)


@pytest.fixture(scope="module")
def gemma_baseline(gemma_pair):
  from specjax import decode  # pylint: disable=g-import-not-at-top
  return decode.generate(gemma_pair[0], PROMPTS, max_new_tokens=MAX_NEW)


def _drafter(kind, pair):
  # pylint: disable=g-import-not-at-top
  from specjax import drafters
  from specjax import testing
  target, draft = pair
  return {
      "model": lambda: draft,
      "early-exit": lambda: drafters.EarlyExit(target, 2),
      # The global layer (2) skipped: the draft runs local layers only.
      "skip-global": lambda: drafters.EarlyExit(target, None, skip=(2,)),
      "lookup": lambda: drafters.PromptLookup(
          vocab_size=target.vocab_size, max_ngram=3, min_ngram=1),
      # Random heads: Medusa on the final hidden state, an EAGLE layer
      # built as one of Gemma's local layers (window, rope, four norms).
      "medusa": lambda: testing.random_medusa(target, 3),
      "eagle": lambda: testing.random_eagle(target),
  }[kind]()


# The draft model on Gemma runs in the default suite through
# docs/nnx_gemma.md (tests/test_own_model.py): specjax's Gemma drafts for an
# NNX Gemma target, and an NNX Gemma drafts for specjax's Gemma target.
@pytest.mark.parametrize("kind", [
    *(pytest.param(k, marks=(pytest.mark.slow, pytest.mark.extended))
      for k in ("model", "early-exit")),
    *(pytest.param(k, marks=pytest.mark.slow)
      for k in ("skip-global", "lookup", "medusa", "eagle"))])
def test_speculative_greedy_equals_generate(gemma_pair, gemma_baseline,
                                            kind):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from specjax import decode  # pylint: disable=g-import-not-at-top
  out = decode.speculative_generate(
      gemma_pair[0], _drafter(kind, gemma_pair), PROMPTS, gamma=3,
      max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(out.tokens, gemma_baseline.tokens)
  np.testing.assert_array_equal(out.lengths, gemma_baseline.lengths)
  assert out.stats.proposed_by_position.sum() > 0


# Whole generations on the tiny Gemma pair, 20 000 rows (about two minutes
# each on a 2-core CPU): `-m extended`. CI covers what they combine: the
# sampler's law (step-level enumeration, and whole generations on the Llama
# pair in tests/test_distribution.py) and Gemma's forward (transformers'
# logits and greedy output: above, and tests/test_generate_hf.py).
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("kind", ["model", "early-exit"])
def test_speculative_sampling_matches_exact_distribution(kind):
  """20 000 samples of 3 tokens after a 3-token prompt (positions 3..5,
  past the window of 4 from position 4 on) against the enumerated joint
  distribution of the tiny Gemma target (`tests/test_distribution.py`)."""
  # pylint: disable=g-import-not-at-top
  from test_distribution import _chi_square
  from test_distribution import _exact_joint
  from test_distribution import _spec_samples
  from test_distribution import VOCAB
  import numpy as np
  target, draft = tiny.gemma3_pair(seed=5, vocab_size=VOCAB)
  # Larger (tied) embeddings spread the logits over the soft-cap's range.
  target, draft = [m.replace(params=dict(m.params,
                                         embed=m.params["embed"] * 50.0))
                   for m in (target, draft)]
  settings = (1.0, 0, 1.0)
  joint = _exact_joint(target, settings)
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  assert joint.max() > 5 / VOCAB ** 3  # not flat: a wrong law would show
  drafter = _drafter(kind, (target, draft))
  samples = _spec_samples((target, drafter), 2, settings, seed=7)
  stat, critical = _chi_square(samples, joint)
  assert stat < critical, (stat, critical)


def test_sentencepiece_bpe_merges_in_file_order():
  """Gemma's tokenizer rebuilt from a GGUF vocabulary: merges ranked by
  the merged token's id, runs of spaces respelled '▁', byte fallback for
  what the vocabulary lacks, control tokens whole."""
  # pylint: disable-next=g-import-not-at-top
  from specjax import tokenizer as tokenizer_lib
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  first = len(tokens)
  tokens += ["\u2581", "h", "e", "l", "o", "he", "ll", "hell", "hello",
             "\u2581hello", "  ", "<start_of_turn>", "el", "hel"]
  types = [3, 3, 3, 2] + [6] * 256 + [1] * 10 + [4, 3, 1, 1]
  backend = tokenizer_lib.sentencepiece_bpe(tokens, types, unk_id=3)
  tok = tokenizer_lib.Tokenizer(backend, bos_id=2, eos_ids=[1])
  ids = {t: i for i, t in enumerate(tokens)}
  assert tok.encode("hello hello") == [ids["hello"], ids["\u2581hello"]]
  # h-e (the merge of id first + 5) goes before l-l (+ 6) and e-l (+ 12):
  # 'hell' is he + ll, 'hel' is he + l.
  assert tok.encode("hell") == [ids["hell"]]
  assert tok.encode("hel") == [ids["hel"]]
  assert tok.encode("  ") == [first + 10]  # the two-space token
  assert tok.encode("é") == [4 + 0xC3, 4 + 0xA9]  # UTF-8 bytes
  assert tok.encode("<start_of_turn>h") == [ids["<start_of_turn>"],
                                             ids["h"]]
  assert tok.decode(tok.encode("hello  é")) == "hello  é"


@pytest.mark.parametrize("geometry", ["chain", "tree"])
def test_local_layers_read_only_their_window(geometry, monkeypatch):
  """Once the cache holds twice the window, a local layer reads only its
  window's W slots per row (`transformer.window_start`); its logits equal
  reading all S slots, for ragged rows and a token tree. (The same terms
  plus masked zeros, summed in another order: float32 rounding.)"""
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  from specjax.models import transformer
  target, _ = tiny.gemma3_pair(seed=3)
  window, size = target.config.sliding_window, 32
  keys = jax.random.split(jax.random.key(0))
  prompts = jax.random.randint(keys[0], (2, 20), 1, target.vocab_size)
  lengths = jnp.array([13, 20], jnp.int32)  # both past the window
  _, cache = target.prefill(prompts, lengths, target.init_cache(2, size))
  chunk = jax.random.randint(keys[1], (2, 5), 1, target.vocab_size)
  if geometry == "tree":
    # Root, two children, one grandchild under each.
    ancestors = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                          [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], bool)
    geometry = dict(positions=lengths[:, None] + jnp.array([0, 1, 1, 2, 2]),
                    mask=jnp.asarray(ancestors)[None])
    assert transformer.window_start(geometry["positions"], size,
                                    window) is not None
  else:
    geometry = {}

  def logits():
    return np.asarray(target(chunk, cache, **geometry)[0].logits)

  windowed = logits()
  monkeypatch.setattr(transformer, "window_start", lambda *args: None)
  np.testing.assert_allclose(windowed, logits(), rtol=1e-5, atol=1e-5)
