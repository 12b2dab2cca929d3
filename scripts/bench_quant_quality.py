r"""Issue 55's quality figures: int8 / int4 on a real model against float32.

Loads a registry model (default the main job's target,
Qwen2.5-Coder-1.5B, dequantised from its GGUF file to float32), then for
float32 and each quantization (the file's own blocks, `int8`, `int4`,
`int4:g64:sym`, applied to the float32 weights; ":a8" with int8
activations too):

- perplexity on a held-out text that ships offline with every Python:
  the standard library's `textwrap.py`, tokenized whole and scored in
  non-overlapping windows of --window tokens, each from an empty cache;
- greedy agreement with float32 on the main job's prompts
  (`configs/llama_pair.py`): how many of N new tokens match float32's
  before the two part, per prompt.

Prints one JSON line per model variant and writes them to --out.

COMMAND: python scripts/bench_quant_quality.py --out=results/quantized/NAME \
    [--model=qwen2.5-coder-1.5b-instruct] [--windows=4] [--window=512] \
    [--n=8] [--tokens=64] [--variants=float32,gguf,gguf:a8,...]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import llama_pair
from experiments import pair as pair_lib
from specjax import decode
from specjax import hardware
from specjax import metrics
from specjax import registry

VARIANTS = ("float32", "gguf", "gguf:a8", "int8", "int8:a8", "int4",
            "int4:a8", "int4:g64:sym")


@jax.jit
def _nll(model, tokens):
  """tokens [1, T] -> summed negative log-likelihood of tokens 1..T-1."""
  out, _ = model(tokens[:, :-1], model.init_cache(1, tokens.shape[1]),
                 cache_is_empty=True)
  logp = jax.nn.log_softmax(out.logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).sum()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
  parser.add_argument("--windows", type=int, default=4)
  parser.add_argument("--window", type=int, default=512)
  parser.add_argument("--n", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  args = parser.parse_args()

  tokenizer = registry.load_tokenizer(args.model)
  with open(textwrap.__file__, encoding="utf-8") as f:
    ids = tokenizer.encode(f.read())
  width = args.window + 1
  count = min(args.windows, len(ids) // width)
  windows = np.asarray(ids[:count * width], np.int32).reshape(count, width)
  config = llama_pair.get_config()
  config.num_prompts = args.n
  _, prompts = pair_lib.encode_prompts(config, tokenizer)

  base, _ = registry.load_pretrained(args.model, progress=False)
  rows, reference = [], None
  for variant in args.variants.split(","):
    start = time.perf_counter()
    if variant == "float32":
      model = base
    elif variant.startswith("gguf"):
      model, _ = registry.load_pretrained(args.model, quantize=variant,
                                          progress=False)
    else:
      model = base.quantize(variant)
    nll = sum(float(_nll(model, jnp.asarray(w[None]))) for w in windows)
    greedy = decode.generate(model, prompts, max_new_tokens=args.tokens)
    outputs = [greedy.row(b) for b in range(len(prompts))]
    reference = reference or outputs
    # Greedy agreement length: tokens equal before the first difference.
    agree = [min(len(a), len(b)) if i is None else i
             for a, b in zip(outputs, reference)
             for i in [metrics.first_difference(a, b)]]
    row = {
        "model": args.model, "variant": variant,
        "quantization": model.quantization,
        "weight_bytes_per_token": model.weight_bytes_per_token,
        "perplexity": math.exp(nll / (count * args.window)),
        "scored_tokens": count * args.window,
        "greedy_agreement": agree,
        "mean_greedy_agreement": float(np.mean(agree)),
        "seconds": time.perf_counter() - start,
    }
    rows.append(row)
    print(json.dumps(row), flush=True)
    if model is not base:
      del model
  float_ppl = rows[0]["perplexity"]
  for row in rows:
    row["perplexity_over_float32"] = row["perplexity"] / float_ppl
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps({
      "machine": hardware.machine(), "python": platform.python_version(),
      "jax": jax.__version__, "text": "textwrap.py of Python "
      + platform.python_version(), "window": args.window,
      "prompts": len(prompts), "max_new_tokens": args.tokens,
      "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
