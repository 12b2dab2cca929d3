"""specjax's GGUF tokenizer agrees with transformers' on the real models.

Marked `real_models`: the GGUF files are fetched into the cache on first use
(`specjax.weights.fetch`). transformers builds its tokenizer from the same
file (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`).
"""

import gc

import numpy as np
import pytest

from specjax import registry
from specjax import weights
from specjax.tokenizer import Tokenizer

pytestmark = pytest.mark.real_models

MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
          "qwen2.5-coder-1.5b-instruct"]

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import numpy as np\n\nx = np.arange(1024).reshape(32, 32)  # 2-D\n",
    "class Stack:\n\tdef push(self, x):\n\t\tself._items.append(x)\r\n",
    "for (int i = 0; i < 100; ++i) { sum += a[i] * 3.14159; }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "   leading spaces,  double  spaces and trailing   ",
    "It's what they'll do; I'M sure we've DONE it.\n\n\n",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, emoji 🤖🚀, ∑∫√",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n<|fim_middle|>",
    '<tool_call>{"name": "f"}</tool_call><|endoftext|>',
    "numbers 1 22 333 4444 55555 0.5 1e-3 0x1F 1,000,000",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that reverses "
                                 "a linked list."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3 * 7?"}],
    [{"role": "user", "content": "Explain `git rebase` vs `git merge`.\n"
                                 "Use bullet points."}],
]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
  """(specjax tokenizer from the GGUF, transformers tokenizer, name)."""
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top

  path = weights.fetch(request.param)
  ours = Tokenizer.from_gguf(path)
  theirs = AutoTokenizer.from_pretrained(str(path.parent),
                                         gguf_file=path.name)
  yield ours, theirs, request.param
  del theirs
  gc.collect()


def test_special_ids(pair):
  ours, theirs, name = pair
  assert ours.vocab_size == len(theirs)
  assert ours.eos_ids[0] == theirs.eos_token_id
  assert ours.bos_id == theirs.bos_token_id
  im_end = theirs.convert_tokens_to_ids("<|im_end|>")
  endoftext = theirs.convert_tokens_to_ids("<|endoftext|>")
  assert set(ours.eos_ids) == {im_end, endoftext}, name
  # The control tokens: transformers' added tokens marked special.
  special = {i for i, t in theirs.added_tokens_decoder.items() if t.special}
  assert set(ours.special_ids) == special, name
  assert {im_end, endoftext} <= special, name


@pytest.mark.parametrize("text", PROMPTS)
def test_encode_decode_agree(pair, text):
  ours, theirs, _ = pair
  ids = ours.encode(text)
  assert ids == theirs(text, add_special_tokens=True)["input_ids"]
  for skip in (False, True):
    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
        ids, skip_special_tokens=skip)
  if text:
    assert ours.decode(ids) == text


def test_special_tokens_are_single_ids(pair):
  ours, theirs, _ = pair
  for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
    assert ours.encode(token) == [theirs.convert_tokens_to_ids(token)]


def test_decode_random_ids_agree(pair):
  ours, theirs, _ = pair
  rng = np.random.default_rng(0)
  for _ in range(20):
    ids = rng.integers(0, ours.vocab_size, size=16).tolist()
    for skip in (False, True):
      assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
          ids, skip_special_tokens=skip)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_agrees(pair, conversation, add_generation_prompt):
  ours, theirs, _ = pair
  text = ours.apply_chat_template(conversation, add_generation_prompt)
  want = theirs.apply_chat_template(
      conversation, tokenize=False,
      add_generation_prompt=add_generation_prompt)
  assert text == want
  assert ours.encode(text) == theirs(text)["input_ids"]


def test_saved_tokenizer_round_trip(pair, tmp_path):
  ours, _, _ = pair
  ours.save(tmp_path)
  again = Tokenizer.from_pretrained_dir(tmp_path)
  for text in PROMPTS:
    assert again.encode(text) == ours.encode(text)
  assert (again.bos_id, again.eos_ids, again.chat_template) == (
      ours.bos_id, ours.eos_ids, ours.chat_template)


def test_registry_tokenizer(pair):
  ours, _, name = pair
  tok = registry.load_tokenizer(name)
  assert tok.encode(PROMPTS[0]) == ours.encode(PROMPTS[0])
  assert tok.eos_ids == ours.eos_ids
