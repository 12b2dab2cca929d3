"""The tuning step: measure this machine once, so calls never time anything.

`speculative_generate(gamma="auto")` prices its steps from cached tables
(`specjax.policies.StepCosts.for_call`) and, where none exists, from a
roofline of bytes and FLOPs. This command measures both ahead of time:
the machine's bandwidth and matmul rate (`tuning.machine`), and, for a
pair, the forward costs at each batch size and cache size the calls will
use (`tuning.cost.step_costs`). Results go to `$SPECJAX_CACHE/tuning/`.

  python -m specjax.tune                       # the machine's roofline only
  python -m specjax.tune --target=qwen2.5-coder-1.5b-instruct \\
      --draft=qwen2.5-coder-0.5b-instruct --batch=1,16 --max_gamma=8 \\
      --prompt_len=256 --max_new_tokens=128

The cache size S is the one a call with `--prompt_len` and
`--max_new_tokens` gets (`padding.default_cache_size`), or `--cache_size`.
"""

from __future__ import annotations

from absl import app
from absl import flags

from specjax import drafters
from specjax import padding
from specjax import registry
from specjax.tuning import cost
from specjax.tuning import machine

_TARGET = flags.DEFINE_string("target", "", "Target: a registry name, a "
                              "directory or file (`load_pretrained`).")
_DRAFT = flags.DEFINE_string("draft", "", "Draft model, as --target; none: "
                             "a drafter without a model (prompt lookup).")
_BATCH = flags.DEFINE_list("batch", ["1"], "Batch sizes B to measure.")
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 8, "γ_max of gamma='auto'.")
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Longest prompt length.")
_TOKENS = flags.DEFINE_integer("max_new_tokens", 128, "max_new_tokens.")
_CACHE = flags.DEFINE_integer("cache_size", 0, "S; 0: as a call gets it.")


def main(argv):
  del argv
  roofline = machine.measure_roofline()
  print(f"machine: {roofline.bandwidth / 1e9:.1f} GB/s, "
        f"{roofline.flops / 1e9:.0f} GFLOP/s")
  if not _TARGET.value:
    return
  target, tokenizer = registry.load_pretrained(_TARGET.value)
  drafter = drafters.PromptLookup().for_target(target, tokenizer)
  if _DRAFT.value:
    drafter = drafters.DraftModel(registry.load_pretrained(_DRAFT.value)[0])
  size = _CACHE.value or padding.default_cache_size(
      _PROMPT.value, _TOKENS.value, _MAX_GAMMA.value + 1)
  for batch in map(int, _BATCH.value):
    costs = cost.step_costs(target, drafter, batch=batch,
                            max_gamma=_MAX_GAMMA.value, cache_size=size)
    print(f"B={batch}, S={size}: target "
          + ", ".join(f"{ms:.1f}" for ms in costs.target_ms)
          + f" ms by width {costs.widths}; draft {costs.draft_ms:.1f} ms "
          f"(first {costs.first_draft_ms:.1f})")


if __name__ == "__main__":
  app.run(main)
