r"""specjax against llama.cpp on the same GGUF file, prompts and threads.

Issue 55's peer benchmark. Both sides decode greedily the main job's
prompts (`configs/llama_pair.py`: HumanEval, Qwen's chat template, the same
token ids), B = 1, up to N new tokens, stopping at the tokenizer's EOS ids:

- specjax: autoregressive on the fp32-dequantised model, on the file's
  own blocks (`quantize="gguf"`) and on the blocks with int8 activations
  (`"gguf:a8"`, llama.cpp's arithmetic), each autoregressive and with
  prompt lookup at γ.
  Each call starts from an empty cache; the first call of each program
  is untimed (compilation), then each prompt is timed whole and with one
  new token (`hardware.timed_call`): the decoding phase is the difference.
- llama.cpp (`llama-cpp-python`, pinned in setup.cfg's `peer` extra; it
  builds llama.cpp from source): `Llama.generate` at temperature 0 with
  `top_k=1`, autoregressive and with `LlamaPromptLookupDecoding` at each
  `num_pred_tokens`. Before every prompt the context is reset, so prompt
  processing is timed too ("end to end"); the decoding phase runs from the
  first generated token to the last.

Also reports where llama.cpp's greedy tokens first differ from each
quantized specjax model's (near-ties between two float orders can part
them).
Writes `results.json` into --out and prints a table.

COMMAND: python scripts/bench_llamacpp.py --out=results/llamacpp/NAME \
    [--target=qwen2.5-coder-1.5b-instruct] [--n=8] [--tokens=64] \
    [--threads=2] [--gamma=8] [--num_pred=2,4,10] \
    [--quantize=fp32,gguf,gguf:a8]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import llama_pair
from experiments import pair as pair_lib
from specjax import decode
from specjax import drafters
from specjax import hardware
from specjax import metrics
from specjax import registry
from specjax import weights


def _rates(tokens: int, seconds: float, decode_tokens: int,
           decode_s: float) -> dict[str, float]:
  return {"tokens": tokens, "seconds": seconds,
          "tokens_per_s": tokens / seconds,
          "decode_tokens_per_s": decode_tokens / decode_s}


def specjax_rows(target_name: str, prompts: Sequence[Sequence[int]],
                 eos: Sequence[int], tokens: int, gamma: int,
                 quantizations: Sequence[str]
                 ) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
  """Each specjax mode's totals over `prompts` (autoregressive and prompt
  lookup for each of `quantizations`, "fp32" the float model), and each
  quantized model's autoregressive greedy tokens."""
  rows, outputs = {}, {}
  # One cache size for every prompt, as the main job: one program a mode.
  common = dict(eos_id=list(eos), cache_size=decode.default_cache_size(
      max(len(p) for p in prompts), tokens, reserve=gamma + 2))
  for quantize in quantizations:
    quantize = None if quantize == "fp32" else quantize
    target, _ = registry.load_pretrained(target_name, quantize=quantize,
                                         progress=False)
    lookup = drafters.PromptLookup(vocab_size=target.vocab_size)
    modes = {"autoregressive": lambda p, n, t=target: decode.generate(
        t, [p], max_new_tokens=n, **common),
             f"lookup γ={gamma}": lambda p, n, t=target: (
                 decode.speculative_generate(t, lookup, [p], gamma=gamma,
                                             max_new_tokens=n, **common))}
    for mode, run in modes.items():
      seen, calls = set(), []
      for p in prompts:
        calls.append(hardware.timed_call(
            lambda max_new_tokens=tokens, p=p: run(p, max_new_tokens),
            key=(mode, quantize), seen=seen, repeats=1))
      name = f"specjax {quantize or 'fp32'} {mode}"
      rows[name] = _rates(
          sum(int(c.output.lengths.sum()) for c in calls),
          sum(c.seconds for c in calls),
          sum(c.decode_tokens for c in calls),
          sum(c.decode_s for c in calls))
      rows[name]["weight_bytes_per_token"] = target.weight_bytes_per_token
      if quantize and mode == "autoregressive":
        outputs[quantize] = [c.output.row(0) for c in calls]
    del target
  return rows, outputs


def llamacpp_rows(path: str, prompts: Sequence[Sequence[int]],
                  eos: Sequence[int], tokens: int, threads: int,
                  num_pred: Sequence[int]
                  ) -> tuple[dict[str, Any], list[list[int]]]:
  """llama.cpp's totals per mode (autoregressive, then prompt lookup at
  each `num_pred`), and its autoregressive greedy tokens."""
  # pylint: disable=g-import-not-at-top
  import llama_cpp
  from llama_cpp import llama_speculative
  rows, outputs = {}, []
  context = max(len(p) for p in prompts) + tokens + 16
  for k in (0, *num_pred):
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=context, n_threads=threads,
        n_threads_batch=threads, n_batch=512, verbose=False,
        draft_model=(llama_speculative.LlamaPromptLookupDecoding(
            num_pred_tokens=k) if k else None))
    list(zip(range(4), llm.generate(prompts[0], top_k=1, temp=0.0)))
    total = seconds = decode_tokens = decode_s = 0.0
    for p in prompts:
      llm.reset()  # an empty cache: the prompt is processed again
      out, start = [], time.perf_counter()
      for token in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == 1:
          first = time.perf_counter()
        if token in eos or len(out) == tokens:
          break
      end = time.perf_counter()
      total, seconds = total + len(out), seconds + end - start
      decode_tokens, decode_s = decode_tokens + len(out) - 1, (
          decode_s + end - first)
      if not k:
        outputs.append(out)
    name = (f"llama.cpp lookup num_pred_tokens={k}" if k
            else "llama.cpp autoregressive")
    rows[name] = _rates(int(total), seconds, int(decode_tokens), decode_s)
    del llm
  return rows, outputs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
  parser.add_argument("--n", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--gamma", type=int, default=8)
  parser.add_argument("--num_pred", default="2,4,10")
  parser.add_argument("--quantize", default="fp32,gguf,gguf:a8",
                      help="specjax's models: fp32, gguf (the file's "
                      "blocks), gguf:a8 (and int8 activations)")
  args = parser.parse_args()

  config = llama_pair.get_config()
  config.num_prompts = args.n
  tokenizer = registry.load_tokenizer(args.target)
  _, prompts = pair_lib.encode_prompts(config, tokenizer)
  eos = tuple(tokenizer.eos_ids)
  spec, spec_tokens = specjax_rows(args.target, prompts, eos, args.tokens,
                                   args.gamma, args.quantize.split(","))
  peer, peer_tokens = llamacpp_rows(
      str(weights.gguf_path(args.target)), prompts, eos, args.tokens,
      args.threads, [int(k) for k in args.num_pred.split(",")])
  rows = {**spec, **peer}
  best_peer = max(peer.values(), key=lambda r: r["decode_tokens_per_s"])
  best_spec = max(spec.values(), key=lambda r: r["decode_tokens_per_s"])
  import llama_cpp  # pylint: disable=g-import-not-at-top
  result = {
      "machine": hardware.machine(), "python": platform.python_version(),
      "jax": jax.__version__, "llama_cpp_python": llama_cpp.__version__,
      "target": args.target, "prompts": len(prompts), "max_new_tokens":
      args.tokens, "threads": args.threads, "rows": rows,
      "best_specjax_over_best_llamacpp_decode": (
          best_spec["decode_tokens_per_s"]
          / best_peer["decode_tokens_per_s"]),
      "best_specjax_over_best_llamacpp_end_to_end": (
          max(r["tokens_per_s"] for r in spec.values())
          / max(r["tokens_per_s"] for r in peer.values())),
      "first_difference_from_llamacpp": {
          name: [metrics.first_difference(a, b)
                 for a, b in zip(tokens, peer_tokens)]
          for name, tokens in spec_tokens.items()},
  }
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(result, indent=2))
  print(f"{'mode':44s} {'tok/s e2e':>10s} {'tok/s decode':>13s}")
  for name, row in rows.items():
    print(f"{name:44s} {row['tokens_per_s']:10.2f} "
          f"{row['decode_tokens_per_s']:13.2f}")
  print("first differences:", result["first_difference_from_llamacpp"])


if __name__ == "__main__":
  main()
