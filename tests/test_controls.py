"""Generation controls: penalties, logit bias, min-p, streaming, lossy rules.

References are independent of the code under test: Hugging Face
`transformers`' own logits processors (repetition penalty, min-p), the
OpenAI definitions written out in numpy, and `generate` with the same
controls, which speculative greedy output must equal token for token, for
chains and trees. Models are `testing.FixedLogitsModel`s (logits follow
the previous token), so each program compiles in seconds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import generation as hf

from specjax import controls as controls_lib
from specjax import acceptance
from specjax import processors
from specjax import decode
from specjax import drafters
from specjax import sampling
from specjax import streaming
from specjax import testing

VOCAB = 16
PROMPTS = [[1, 2, 3], [5], [7, 7, 9, 11, 4]]
MAX_NEW = 12


def _tables():
  """[V, V] target and draft logits, the draft a noisy copy: it agrees
  with the target often, not always."""
  target = 2.0 * jax.random.normal(jax.random.key(0), (VOCAB, VOCAB))
  noise = 1.0 * jax.random.normal(jax.random.key(1), (VOCAB, VOCAB))
  return target, target + noise


TARGET, DRAFT = (testing.FixedLogitsModel(t) for t in _tables())

# Each control alone is the others at their neutral values: every case
# then runs one compiled program (values are traced), and the neutral
# values are themselves checked to change nothing.
NEUTRAL = dict(repetition_penalty=1.0, frequency_penalty=0.0,
               presence_penalty=0.0, logit_bias={0: 0.0}, min_p=0.0)
CONTROLS = {name: {**NEUTRAL, **kw} for name, kw in {
    "neutral": {},
    "repetition": dict(repetition_penalty=1.6),
    "frequency": dict(frequency_penalty=0.8),
    "presence": dict(presence_penalty=1.5),
    "bias": dict(logit_bias={3: 8.0, 9: -100.0}),
    "min_p": dict(min_p=0.2),
    "combined": dict(repetition_penalty=1.3, frequency_penalty=0.4,
                     presence_penalty=0.6, logit_bias={5: 1.5}, min_p=0.1),
}.items()}


# ------------------------------------------------ processing vs references


def _apply(controls, logits, prompt, output):
  """Controls.apply on one row whose prompt and output are id lists."""
  state = controls.start(jnp.asarray([prompt]), jnp.asarray([len(prompt)]),
                         VOCAB)
  for token in output:
    state = state.advance(jnp.asarray([token]))
  return np.asarray(state.apply(jnp.asarray(logits)[None]))[0]


def test_repetition_penalty_matches_transformers():
  logits = np.asarray(TARGET.table[4])
  prompt, output = [1, 2, 2], [5, 9, 1]
  controls = controls_lib.Controls.create(VOCAB, repetition_penalty=1.7)
  want = hf.RepetitionPenaltyLogitsProcessor(1.7)(
      torch.tensor([prompt + output]), torch.tensor(logits[None]))[0]
  np.testing.assert_allclose(_apply(controls, logits, prompt, output),
                             want.numpy(), rtol=1e-6)


def test_openai_penalties_and_bias():
  logits = np.asarray(TARGET.table[2])
  prompt, output = [3, 3, 4], [5, 5, 5, 6]
  controls = controls_lib.Controls.create(
      VOCAB, presence_penalty=0.5, frequency_penalty=-0.25,
      logit_bias={0: 3.0, 3: -2.0})
  counts = np.bincount(output, minlength=VOCAB)  # the output only
  bias = np.zeros(VOCAB)
  bias[[0, 3]] = [3.0, -2.0]
  want = logits - counts * -0.25 - (counts > 0) * 0.5 + bias
  np.testing.assert_allclose(_apply(controls, logits, prompt, output), want,
                             rtol=1e-6)


def test_min_p_matches_transformers():
  logits = np.asarray(TARGET.table[6])
  params = sampling.SamplingParams.create(0.8, min_p=0.3)
  got = np.asarray(sampling.probabilities(jnp.asarray(logits), params))
  scores = hf.MinPLogitsWarper(0.3)(
      None, hf.TemperatureLogitsWarper(0.8)(None, torch.tensor(logits[None])))
  np.testing.assert_allclose(got, torch.softmax(scores, -1)[0].numpy(),
                             rtol=1e-5, atol=1e-7)


def test_along_chain_counts_the_drafted_prefix():
  controls = controls_lib.Controls.create(VOCAB, frequency_penalty=1.0)
  state = controls.start(jnp.asarray([[1]]), jnp.asarray([1]), VOCAB)
  state = state.advance(jnp.asarray([4]))
  along = state.along_chain(jnp.asarray([[4, 7, 4]]))
  counts = np.asarray(along.find(processors.FrequencyPenalty).state)[0]
  # [G+1, V]
  np.testing.assert_array_equal(counts[:, 4], [1, 2, 2, 3])
  np.testing.assert_array_equal(counts[:, 7], [0, 0, 1, 1])


def test_along_tree_counts_each_nodes_own_path():
  from specjax import tree  # pylint: disable=g-import-not-at-top
  controls = controls_lib.Controls.create(VOCAB, frequency_penalty=1.0)
  state = controls.start(jnp.asarray([[1]]), jnp.asarray([1]), VOCAB)
  tokens = jnp.asarray([[4, 5, 4, 5]])
  parents = jnp.asarray([[-1, -1, 0, 1]])  # two branches of depth 2
  mask = tree.ancestor_mask(parents, jnp.ones((1, 4), bool))
  along = state.along_tree(tokens, parents, mask[:, 1:, 1:])
  counts = np.asarray(along.find(processors.FrequencyPenalty).state)[0]
  np.testing.assert_array_equal(counts[:, 4], [0, 1, 0, 2, 0])
  np.testing.assert_array_equal(counts[:, 5], [0, 0, 1, 0, 2])


# ------------------------------------------------ greedy exactness


@pytest.fixture(scope="module")
def baselines():
  return {name: decode.generate(TARGET, PROMPTS, max_new_tokens=MAX_NEW,
                                **kw) for name, kw in CONTROLS.items()}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_greedy_chain_equals_generate(baselines, name):
  want = baselines[name]
  plain = decode.generate(TARGET, PROMPTS, max_new_tokens=MAX_NEW)
  # Greedy: min-p never removes the argmax.
  changes = name not in ("neutral", "min_p")
  assert np.array_equal(want.tokens, plain.tokens) != changes, name
  got = decode.speculative_generate(TARGET, DRAFT, PROMPTS, gamma=3,
                                    max_new_tokens=MAX_NEW,
                                    **CONTROLS[name])
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  assert got.stats.accepted_by_position[0] > 0  # the draft did help
  assert got.lossless


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_greedy_tree_equals_generate(baselines, drafter):
  draft = (drafters.DraftModel(DRAFT) if drafter == "model" else
           drafters.PromptLookup(vocab_size=VOCAB, max_ngram=2, min_ngram=1))
  got = decode.speculative_generate(TARGET, draft, PROMPTS, gamma=2,
                                    num_nodes=4, max_new_tokens=MAX_NEW,
                                    **CONTROLS["combined"])
  np.testing.assert_array_equal(got.tokens, baselines["combined"].tokens)


def test_changing_a_penalty_does_not_recompile():
  from specjax import compilation  # pylint: disable=g-import-not-at-top
  decode.generate(TARGET, PROMPTS, max_new_tokens=MAX_NEW,
                  **dict(NEUTRAL, repetition_penalty=1.1, logit_bias={1: 1}))
  before = compilation.num_compiled()
  decode.generate(TARGET, PROMPTS, max_new_tokens=MAX_NEW,
                  **dict(NEUTRAL, repetition_penalty=1.9, min_p=0.3,
                         logit_bias={2: -3.0, 4: 1.0}))
  assert compilation.num_compiled() == before


# ------------------------------------------------ streaming


@pytest.mark.parametrize("gamma", [None, 3])
def test_stream_concatenates_to_the_output_once_per_step(gamma):
  calls = []
  kw = dict(max_new_tokens=MAX_NEW, eos_id=0, on_tokens=calls.append,
            **CONTROLS["combined"])
  if gamma is None:
    out = decode.generate(TARGET, PROMPTS, **kw)
    steps = int(out.lengths.max()) - 1
  else:
    out = decode.speculative_generate(TARGET, DRAFT, PROMPTS, gamma=gamma,
                                      **kw)
    steps = int(out.stats.steps)
  assert len(calls) == steps + 1  # the prefill's token, then every step
  for b in range(len(PROMPTS)):
    assert sum((c[b] for c in calls), []) == out.row(b)


def test_text_stream_releases_whole_characters():
  class Bytes:  # token i decodes to one byte of "é→"
    data = "é→".encode()

    def decode(self, ids):
      return bytes(self.data[i] for i in ids).decode("utf-8", "replace")

  deltas = []
  text = streaming.TextStream(Bytes(), lambda b, d: deltas.append(d))
  for step in [[[0]], [[1, 2]], [[3]], [[4]]]:
    text(step)
  assert deltas == ["é", "→"] and text.texts == ["é→"]


# ------------------------------------------------ lossy acceptance


def test_typical_acceptance_under_greedy_is_exact_and_labelled(baselines):
  got = decode.speculative_generate(TARGET, DRAFT, PROMPTS, gamma=3,
                                    max_new_tokens=MAX_NEW,
                                    acceptance="typical")
  want = decode.generate(TARGET, PROMPTS, max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert not got.lossless


def test_typical_rule_by_hand():
  # p rows: a peaked one (entropy ~0), a flat one (entropy log 4).
  p = jnp.asarray([[[0.97, 0.01, 0.01, 0.01], [0.25] * 4,
                    [0.25] * 4]])  # [1, G+1=3, V=4]
  typical = acceptance.Typical.create(epsilon=0.2, delta=0.9)
  judge = lambda tokens: typical.judge(jax.random.key(0), acceptance.Drafts(
      tokens=jnp.asarray(tokens), q=None, p=p, num_drafted=None,
      positions=jnp.zeros((1,), jnp.int32)))
  # Position 0: bar min(0.2, 0.9 e^-H) ~ 0.2 > 0.01: token 1 rejected.
  n, _ = judge([[1, 2]])
  assert int(n[0]) == 0
  # Token 0 (0.97) passes; position 1: bar min(0.2, 0.9/4) = 0.2 <= 0.25.
  n, _ = judge([[0, 2]])
  assert int(n[0]) == 2


def test_relaxed_threshold_accepts_more_than_exact():
  kw = dict(max_new_tokens=MAX_NEW, temperature=1.0, key=3)
  prompts = PROMPTS * 4
  exact = decode.speculative_generate(TARGET, DRAFT, prompts, gamma=3, **kw)
  relaxed = decode.speculative_generate(
      TARGET, DRAFT, prompts, gamma=3, acceptance="relaxed",
      acceptance_threshold=0.3, **kw)
  rate = lambda o: o.stats.accepted_by_position.sum() / (
      o.stats.proposed_by_position.sum())
  assert rate(relaxed) > rate(exact) + 0.05
  assert exact.lossless and not relaxed.lossless


# ------------------------------------------------ errors


@pytest.mark.parametrize("kw, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in"),
    (dict(logit_bias={VOCAB: 1.0}), "outside the vocabulary"),
    (dict(logit_bias={1: 101.0}), r"logit_bias\[1\] must be in"),
    (dict(logit_bias=[1.0]), "must be a mapping"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(stop="\n"), "stop must be a list of strings"),
    (dict(stop=["a", ""]), "non-empty strings"),
    (dict(stop=["a"]), "needs the model's tokenizer"),
    (dict(regex="[ab]+"), "needs the model's tokenizer"),
    (dict(on_tokens=3), "on_tokens must be callable"),
])
def test_invalid_controls_raise_clear_errors(kw, message):
  with pytest.raises((ValueError, TypeError), match=message):
    decode.generate(TARGET, PROMPTS, max_new_tokens=4, **kw)


@pytest.mark.parametrize("kw, message", [
    (dict(acceptance="loose"), "acceptance must be 'exact' or one of"),
    (dict(acceptance="relaxed", acceptance_threshold=0.0),
     "acceptance_threshold must be in"),
    (dict(acceptance="typical", num_nodes=4), "chains only"),
])
def test_invalid_acceptance_raises(kw, message):
  with pytest.raises(ValueError, match=message):
    decode.speculative_generate(TARGET, DRAFT, PROMPTS, gamma=2,
                                max_new_tokens=4, **kw)


# ------------------------------------------------ stop strings


class _Words:
  """A tokenizer stand-in: token i decodes to WORDS[i], some of them
  several characters, so a stop string can sit inside one token or span
  several."""

  WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "ab", "cd", "ef", "gh",
           " ", "\n", "x", "yz"]

  def token_bytes(self):
    return [w.encode() for w in self.WORDS]

  def decode(self, ids):
    return "".join(self.WORDS[i] for i in ids)


def _reference_stop(ids, stop):
  """The index of the token after which the decoded text first contains a
  stop string (str search), or None."""
  for i in range(len(ids)):
    if any(s in _Words().decode(ids[:i + 1]) for s in stop):
      return i
  return None


def _step_ranges(out):
  """Each step's [first, last] output index per row (the prefill's token
  is index 0)."""
  ranges = []
  for row in np.asarray(out.stats.accepted):
    start, spans = 1, []
    for accepted in row[row >= 0]:
      spans.append((start, start + accepted))
      start += accepted + 1
    ranges.append(spans)
  return ranges


@pytest.mark.parametrize("gamma", [1, 3])
def test_stop_strings_truncate_where_generate_does(gamma):
  # Greedy, so that `generate` is the reference token for token; the
  # penalties keep the text from cycling.
  kw = dict(max_new_tokens=MAX_NEW, **CONTROLS["combined"])
  prompts = [[1], [2], [3], [4], [6], [8]]
  free = decode.speculative_generate(TARGET, DRAFT, prompts, gamma=gamma,
                                     **kw)
  checked = set()
  for b, spans in enumerate(_step_ranges(free)):
    ids = free.row(b)
    for first, last in spans:
      # A stop string made of the text around a token inside the step's
      # block (mid-block) or around the step's first token (across two
      # steps), when it occurs nowhere earlier.
      for k, where in ((first + 1, "block"), (first, "steps")):
        if not 1 <= k <= last or k >= len(ids):
          continue
        stop = [_Words().decode(ids[k - 1:k + 1])[-3:]]
        if _reference_stop(ids, stop) != k:
          continue
        got = decode.speculative_generate(TARGET, DRAFT, prompts,
                                          gamma=gamma, stop=stop,
                                          tokenizer=_Words(), **kw)
        want = decode.generate(TARGET, prompts, stop=stop,
                               tokenizer=_Words(), **kw)
        assert got.row(b) == ids[:k + 1] == want.row(b), (stop, where)
        assert got.finish_reason[b] == "stop" == want.finish_reason[b]
        assert got.text(_Words(), b).endswith(stop[0])
        checked.add(where if where == "steps" or k < last else "end")
  # With γ = 1 a block is two tokens: none is mid-block.
  assert ({"steps"} if gamma == 1 else {"block", "steps"}) <= checked, (
      checked)


def test_a_stop_string_inside_one_token_and_eos_and_length():
  # "d" sits inside token 9 ("cd"); text after it in the token is cut.
  tokens = decode.generate(TARGET, [[9]], max_new_tokens=MAX_NEW).row(0)
  stop = ["zz"] if 15 not in tokens else ["qq"]  # never occurs
  out = decode.generate(TARGET, [[9], [1]], max_new_tokens=MAX_NEW,
                        stop=stop, tokenizer=_Words(), eos_id=tokens[2])
  assert out.finish_reason[0] == "eos" and out.lengths[0] == 3
  assert out.finish_reason[1] in ("eos", "length")
  words = _Words()
  first = next(i for i, t in enumerate(tokens) if len(words.WORDS[t]) > 1)
  inner = [words.WORDS[tokens[first]][0]]
  want = _reference_stop(tokens, inner)
  out = decode.generate(TARGET, [[9]], max_new_tokens=MAX_NEW, stop=inner,
                        tokenizer=words)
  assert out.lengths[0] == want + 1 and out.finish_reason == ("stop",)
  assert out.text(words, 0).endswith(inner[0])


# ------------------------------------------------ structured output

REGEX = "(ab|cd|[a-d])+ (x|yz){2,3}"


def _jump(draft=DRAFT):
  return drafters.Fallback(drafters.JumpForward(VOCAB),
                           drafters.DraftModel(draft))


@pytest.mark.parametrize("draft, gamma, nodes", [
    (DRAFT, 3, None), ("jump", 3, None), (DRAFT, 2, 4)])
def test_regex_outputs_match_and_equal_generate(draft, gamma, nodes):
  kw = dict(max_new_tokens=MAX_NEW, regex=REGEX, tokenizer=_Words(),
            eos_id=13)
  want = decode.generate(TARGET, PROMPTS, **kw)
  got = decode.speculative_generate(
      TARGET, _jump() if draft == "jump" else draft, PROMPTS, gamma=gamma,
      num_nodes=nodes, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  import re  # pylint: disable=g-import-not-at-top
  for b in range(len(PROMPTS)):
    text = _Words().decode(got.row(b)[:-1])
    if got.finish_reason[b] == "eos":
      assert re.fullmatch(REGEX, text), text
    else:  # cut at N tokens: a prefix of a match
      assert re.fullmatch(REGEX, text + " xx") or re.fullmatch(
          REGEX, text + "xx") or re.fullmatch(REGEX, text), text


def test_json_schema_outputs_validate_and_jump_forward_drafts_free():
  import json  # pylint: disable=g-import-not-at-top
  import jsonschema  # pylint: disable=g-import-not-at-top
  from test_grammar import byte_level  # pylint: disable=g-import-not-at-top
  tok = byte_level()
  vocab = tok.vocab_size
  target = testing.FixedLogitsModel(
      jax.random.normal(jax.random.key(5), (vocab, vocab)))
  schema = {"type": "object", "required": ["name", "ok"],
            "properties": {"name": {"enum": ["ab", "abc", "hello"]},
                           "ok": {"type": "boolean"}}}
  kw = dict(max_new_tokens=64, json_schema=schema, tokenizer=tok,
            eos_id=list(tok.eos_ids), temperature=1.0)
  prompts = [[i] for i in range(1, 9)]
  jump = drafters.Fallback(drafters.JumpForward(vocab),
                           drafters.PromptLookup(vocab_size=vocab))
  out = decode.speculative_generate(target, jump, prompts, gamma=4, **kw)
  for b in range(len(prompts)):
    assert out.finish_reason[b] == "eos"
    jsonschema.validate(json.loads(tok.decode(out.row(b)[:-1])), schema)
  # Field names and punctuation are forced (the optional whitespace is
  # not): a good share of the tokens comes free, far more than lookup
  # alone drafts.
  accepted = out.stats.accepted_by_position.sum()
  assert accepted > 0.3 * out.lengths.sum(), (accepted, out.lengths)
  alone = decode.speculative_generate(
      target, drafters.PromptLookup(vocab_size=vocab), prompts, gamma=4,
      **kw).stats.accepted_by_position.sum()
  assert accepted > 2 * alone, (accepted, alone)
  greedy = dict(kw, temperature=0.0)
  np.testing.assert_array_equal(
      decode.speculative_generate(target, jump, prompts, gamma=4,
                                  **greedy).tokens,
      decode.generate(target, prompts, **greedy).tokens)


@pytest.mark.parametrize("kw, message", [
    (dict(regex="(ab", eos_id=13), "outlines-core cannot build"),
    (dict(json_schema="{not json", eos_id=13), "schema"),
    (dict(regex="a", json_schema={"type": "string"}, eos_id=13),
     "not both"),
    (dict(regex="[ab]+"), "needs eos_id"),
])
def test_invalid_grammars_raise_clear_errors(kw, message):
  with pytest.raises(ValueError, match=message):
    decode.generate(TARGET, PROMPTS, max_new_tokens=4, tokenizer=_Words(),
                    **kw)


def test_jump_forward_without_a_grammar_raises():
  with pytest.raises(ValueError, match="pass regex= or json_schema="):
    decode.speculative_generate(TARGET, _jump(), PROMPTS, gamma=2,
                                max_new_tokens=4)
