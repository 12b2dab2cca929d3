"""Bad input fails early with a message that names the problem."""

import pytest

from specjax import decode
from specjax import models
from specjax import testing


def test_mismatched_vocabularies(pair):
  target, _ = pair
  _, other = testing.tiny_pair(seed=0, vocab_size=100)
  with pytest.raises(ValueError, match="vocabularies differ.*100.*128"):
    decode.speculative_generate(target, other, [[1]], gamma=2,
                                max_new_tokens=4)


@pytest.mark.parametrize("gamma", [0, -1, 1.5])
def test_gamma_below_one(pair, gamma):
  with pytest.raises(ValueError, match="gamma must be an integer >= 1"):
    decode.speculative_generate(*pair, [[1]], gamma=gamma, max_new_tokens=4)


def test_cache_too_short_for_prompt_tokens_and_gamma(pair):
  # 10 + 8 + (gamma + 1 = 5) = 23 > 20.
  with pytest.raises(ValueError, match="cache is too short.*needs 23.*=20"):
    decode.speculative_generate(*pair, [list(range(10))], gamma=4,
                                max_new_tokens=8, cache_size=20)


def test_prompt_longer_than_cache(pair):
  with pytest.raises(ValueError, match="cache is too short.*40 tokens"):
    decode.generate(pair[0], [list(range(40))], max_new_tokens=4,
                    cache_size=32)


@pytest.mark.parametrize("prompts, match", [
    ([[1, 2], []], "Prompt 1 is empty"),
    ([], "non-empty list"),
    ([[1, 500]], r"outside \[0, 128\)"),
])
def test_bad_prompts(pair, prompts, match):
  with pytest.raises(ValueError, match=match):
    decode.generate(pair[0], prompts, max_new_tokens=4)


@pytest.mark.parametrize("kw, match", [
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_bad_sampling_parameters(pair, kw, match):
  kw = {"max_new_tokens": 4, **kw}
  with pytest.raises(ValueError, match=match):
    decode.generate(pair[0], [[1]], **kw)
  with pytest.raises(ValueError, match=match):
    decode.speculative_generate(*pair, [[1]], gamma=2, **kw)


def test_bad_synthetic_rate(pair):
  with pytest.raises(ValueError, match="synthetic_acceptance"):
    decode.speculative_generate(*pair, [[1]], gamma=2, max_new_tokens=4,
                                synthetic_acceptance=1.5)


def test_params_from_wrong_config(pair):
  target, _ = pair
  with pytest.raises(ValueError, match="missing tensor 'layers_2/q'"):
    models.check_params(testing.TINY_TARGET.replace(num_layers=3),
                        target.params)


@pytest.mark.parametrize("draft", ["qwen2.5-coder-0.5b-instruct", 3, None])
def test_a_draft_that_is_no_model_names_the_problem(pair, draft):
  with pytest.raises(TypeError, match="draft must be a specjax.models."
                     "LanguageModel or a specjax.drafters.Drafter"):
    decode.speculative_generate(pair[0], draft, [[1]], gamma=2,
                                max_new_tokens=4)


def test_a_target_given_by_name_names_the_problem(pair):
  with pytest.raises(TypeError, match="target must be.*load it first"):
    decode.speculative_generate("qwen2.5-coder-1.5b-instruct", pair[1],
                                [[1]], gamma=2, max_new_tokens=4)
  with pytest.raises(TypeError, match="model must be.*load it first"):
    decode.generate("qwen2.5-coder-1.5b-instruct", [[1]], max_new_tokens=4)


@pytest.mark.parametrize("eos_id", [128, -1, [3, 999]])
def test_an_eos_id_outside_the_vocabulary(pair, eos_id):
  with pytest.raises(ValueError, match=r"eos_id .* outside the vocabulary "
                     r"\[0, 128\)"):
    decode.generate(pair[0], [[1]], max_new_tokens=4, eos_id=eos_id)
  with pytest.raises(ValueError, match=r"outside the vocabulary"):
    decode.speculative_generate(*pair, [[1]], gamma=2, max_new_tokens=4,
                                eos_id=eos_id)
