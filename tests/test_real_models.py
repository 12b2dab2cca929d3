"""specjax logits match transformers' on the small real offline models.

Marked `real_models`. specjax loads each GGUF file through
`specjax.registry.load_pretrained` (fetch + convert on first use, restore
afterwards); transformers' reference and the check are in
`tests/real_reference.py`. The pair's target is `test_real_pair.py`.
"""

import jax.numpy as jnp
import pytest

from specjax import registry
from tests import real_reference

pytestmark = pytest.mark.real_models


@pytest.mark.parametrize("name", ["smollm2-135m-instruct",
                                  "qwen2.5-coder-0.5b-instruct"])
def test_logits_match_transformers(name):
  reference = real_reference.transformers_results(name)
  model, _ = registry.load_pretrained(name, jnp.float32)
  real_reference.check_logits(name, reference, model)
