r"""specjax against llama.cpp on the same GGUF file, prompts and threads.

The peer benchmark. Both sides decode greedily the main job's
prompts (`configs/llama_pair.py`: HumanEval, Qwen's chat template, the same
token ids), B = 1, up to N new tokens, stopping at the tokenizer's EOS ids:

- specjax: autoregressive on the fp32-dequantised model, on the file's
  own blocks (`quantize="gguf"`) and on the blocks with int8 activations
  (`"gguf:a8"`, llama.cpp's arithmetic), each autoregressive and with
  prompt lookup at γ.
  Each call starts from an empty cache; the first call of each program
  is untimed (compilation), then each prompt is timed whole and with one
  new token (`hardware.timed_call`): the decoding phase is the difference.
- llama.cpp through `llama-cpp-python` (pinned in setup.cfg's `peer`
  extra): `Llama.generate` at temperature 0 with `top_k=1`, autoregressive
  and with `LlamaPromptLookupDecoding` at each `num_pred_tokens`. Before
  every prompt the context is reset, so prompt processing is timed too
  ("end to end"); the decoding phase runs from the first generated token
  to the last.
- llama.cpp's own programs, built by `scripts/build_llamacpp.sh` from the
  llama.cpp that the pinned release vendors into --llamacpp_bin (whose
  `libllama.so` llama-cpp-python then loads too: one build for both):
  `llama-completion` (autoregressive), `llama-speculative` and
  `llama-speculative-simple` with --draft's GGUF file at each
  --draft_max and --draft_p_min, and `llama-lookup` (its n-gram cache) at
  each --draft_max. Each run gets the templated prompt text (with
  `--no-escape`; the tools print how many tokens it encodes to, checked
  against ours), `--temp 0 --top-k 1`, `-t`/`-tb`/`-td` --threads. The
  figures are the tools' own: "encoded"/"decoded" lines (the speculative
  tools and lookup) or `prompt eval time`/`eval time` (completion); end to
  end is prompt processing (for the draft model too) plus decoding, from an
  empty cache, model loading and warm-up excluded. A tool whose binary is
  absent is skipped with the reason printed. The tools print text, not
  ids: their output is compared with specjax's greedy tokens as text.

The build leaves AMX out (`-mno-amx-*`): see `AMX_NOTE`.

Also reports where llama.cpp's greedy tokens first differ from each
quantized specjax model's (near-ties between two float orders can part
them).
Writes `results.json` into --out and prints a table.

COMMAND: scripts/build_llamacpp.sh --python && \
  python scripts/bench_llamacpp.py --out=results/llamacpp/NAME \
    [--target=qwen2.5-coder-1.5b-instruct] [--n=8] [--tokens=64] \
    [--threads=2] [--gamma=8] [--num_pred=2,4,10] \
    [--quantize=fp32,gguf,gguf:a8] [--llamacpp_bin=DIR] \
    [--draft=qwen2.5-coder-0.5b-instruct] [--draft_max=4,8,16] \
    [--draft_p_min=0.75] [--tools=completion,speculative,\
    speculative-simple,lookup] [--omp_wait_policy=passive]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
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
    target, tokenizer = registry.load_pretrained(
        target_name, quantize=quantize, progress=False)
    lookup = drafters.PromptLookup().for_target(target, tokenizer)
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



# Why scripts/build_llamacpp.sh leaves AMX out: recorded in results.json.
AMX_NOTE = (
    "llama.cpp is built with GGML_NATIVE=OFF and ggml's x86 options for "
    "the CPU's features (AVX2, AVX512, AVX512_VBMI/VNNI/BF16, AVX_VNNI, "
    "FMA, F16C, BMI2) but GGML_AMX_TILE/INT8/BF16=OFF. Built with "
    "-march=native (GGML_NATIVE=ON; system_info AMX_INT8 = 1) on an Intel "
    "Xeon family 6 model 207 VM (Firecracker guest kernel), every run "
    "died on the first decode (the warm-up) with SIGILL, 1 or 2 threads: "
    "the kernel logs 'trap invalid opcode' at tilezero in "
    "ggml_backend_amx_mul_mat, ggml-cpu's AMX buffer type. The same build "
    "runs with --no-repack (no extra buffer types, so no AMX kernels), "
    "and a minimal AMX program (ARCH_REQ_XCOMP_PERM, ldtilecfg, tilezero) "
    "runs in the same VM: AMX itself works there, ggml's AMX path does "
    "not.")

# --tools: llama.cpp's program for each.
TOOLS = {"completion": "llama-completion",
         "speculative": "llama-speculative",
         "speculative-simple": "llama-speculative-simple",
         "lookup": "llama-lookup"}
# The speculative tools' and lookup's own figures.
_CODED = re.compile(r"\b(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
# llama_perf_context_print's, for llama-completion.
_PERF = re.compile(
    r"\b(prompt eval|eval) time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)")
_COUNTS = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")


def text_first_difference(tokenizer: Any, ids: Sequence[int], text: str,
                          eos: Sequence[int]) -> int | None:
  """The first of `ids` (EOS ids dropped) whose text `text` does not
  continue with; None when all of them match (`text` may go on)."""
  ids = [i for i in ids if i not in eos]
  for n in range(1, len(ids) + 1):
    if not text.startswith(tokenizer.decode(ids[:n])):
      return n - 1
  return None


def _tool_modes(tools: Sequence[str], draft_path: str, draft_max: Sequence[int],
                p_min: Sequence[float], threads: int
                ) -> list[tuple[str, str, list[str]]]:
  """(row name, tool, its own flags) of each llama.cpp program run."""
  draft = ["-md", draft_path, "-td", str(threads), "-tbd", str(threads)]
  modes = []
  for tool in tools:
    if tool == "completion":
      modes.append(("llama.cpp completion (autoregressive)", tool,
                    ["-no-cnv", "--no-display-prompt"]))
    elif tool in ("speculative", "speculative-simple"):
      kind = ["--spec-type", "draft-simple"] if tool.endswith("simple") else []
      for m in draft_max:
        for p in p_min:
          modes.append((f"llama.cpp {tool} draft-max={m} p-min={p:g}", tool,
                        [*draft, *kind, "--spec-draft-n-max", str(m),
                         "--spec-draft-p-min", str(p)]))
    elif tool == "lookup":
      for m in draft_max:
        modes.append((f"llama.cpp lookup draft-max={m}", tool,
                      ["--spec-draft-n-max", str(m)]))
    else:
      raise ValueError(f"unknown tool {tool!r}; known: {sorted(TOOLS)}")
  return modes


def _parse_tool(tool: str, stdout: str, stderr: str, prompt_text: str
                ) -> dict[str, Any]:
  """One run's prompt and generated counts, seconds and generated text."""
  if tool == "completion":
    perf = {m[0]: (float(m[1]) / 1e3, int(m[2]))
            for m in _PERF.findall(stderr)}
    (enc_s, prompt_n), (dec_s, runs) = perf["prompt eval"], perf["eval"]
    # The first token comes from the prompt's pass, each later one from an
    # eval run: runs + 1 tokens, runs of them in the decoding phase.
    row = {"prompt_tokens": prompt_n, "prompt_s": enc_s, "tokens": runs + 1,
           "decode_tokens": runs, "decode_s": dec_s}
    text = stdout.replace(" [end of text]", "")
  else:
    coded = {m[0]: (int(m[1]), float(m[2])) for m in _CODED.findall(stderr)}
    (prompt_n, enc_s), (tokens, dec_s) = coded["encoded"], coded["decoded"]
    row = {"prompt_tokens": prompt_n, "prompt_s": enc_s, "tokens": tokens,
           "decode_tokens": tokens, "decode_s": dec_s}
    row.update({k: int(v) for k, v in _COUNTS.findall(stderr)[:2]})
    start = stdout.find(prompt_text)  # the tools echo the prompt first
    text = stdout[start + len(prompt_text):] if start >= 0 else stdout
  row["text"] = text
  return row


def tool_rows(bin_dir: pathlib.Path, tools: Sequence[str], target_path: str,
              draft_path: str, texts: Sequence[str],
              prompts: Sequence[Sequence[int]], tokens: int, threads: int,
              draft_max: Sequence[int], p_min: Sequence[float],
              log_dir: pathlib.Path, timeout: float = 900.0
              ) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, str],
                         str]:
  """llama.cpp's own programs on each prompt text.

  Args:
    bin_dir: where `scripts/build_llamacpp.sh` put the programs.
    tools: keys of `TOOLS` to run.
    target_path: the target's GGUF file.
    draft_path: the draft's GGUF file (speculative tools).
    texts: the templated prompts, as text.
    prompts: their token ids (ours), to check the tools' prompt lengths.
    tokens: N, the most new tokens.
    threads: threads for prompt and decoding, target and draft.
    draft_max: each `--spec-draft-n-max` to run (lookup's draft length).
    p_min: each `--spec-draft-p-min` to run (speculative tools).
    log_dir: each run's stdout and stderr go here.
    timeout: seconds one run may take.

  Returns:
    Each mode's totals (`_rates` plus the tools' counts), each mode's
    generated texts, the reason each skipped mode or tool was skipped,
    and llama.cpp's system_info line.
  """
  rows, texts_out, skipped, system_info = {}, {}, {}, ""
  context = max(len(p) for p in prompts) + tokens + 64
  common = ["-m", target_path, "--no-escape", "-n", str(tokens),
            "-c", str(context), "-t", str(threads), "-tb", str(threads),
            "--temp", "0", "--top-k", "1", "--seed", "1"]
  log_dir.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    files = []
    for i, text in enumerate(texts):
      files.append(pathlib.Path(tmp) / f"prompt{i}.txt")
      # -f drops one trailing newline: the template's last one must stay.
      files[-1].write_text(text + "\n", encoding="utf-8")
    for name, tool, flags in _tool_modes(tools, draft_path, draft_max, p_min,
                                         threads):
      binary = bin_dir / TOOLS[tool]
      if not binary.exists():
        skipped[tool] = (f"{binary} not found: build it with "
                         "scripts/build_llamacpp.sh")
        continue
      if "-md" in flags and not pathlib.Path(draft_path).exists():
        skipped[name] = f"no draft GGUF file at {draft_path}"
        continue
      runs = []
      for i, (path, text) in enumerate(zip(files, texts)):
        slug = re.sub(r"[^A-Za-z0-9.=-]+", "_", name)
        cmd = [str(binary), *common, "-f", str(path), *flags]
        try:
          proc = subprocess.run(cmd, capture_output=True, timeout=timeout,
                                check=False)
        except subprocess.TimeoutExpired:
          skipped[name] = f"prompt {i} ran past {timeout:.0f} s"
          break
        stdout = proc.stdout.decode("utf-8", "replace")
        stderr = proc.stderr.decode("utf-8", "replace")
        (log_dir / f"{slug}.{i}.log").write_text(
            " ".join(cmd) + f"\nexit {proc.returncode}\n--- stdout\n"
            + stdout + "\n--- stderr\n" + stderr, encoding="utf-8")
        if not system_info:
          system_info = next((line.strip() for line in stderr.splitlines()
                              if "system_info" in line), "")
        if proc.returncode:
          skipped[name] = (f"prompt {i}: exit {proc.returncode}: "
                           + stderr.strip()[-300:])
          break
        try:
          runs.append(_parse_tool(tool, stdout, stderr, text))
        except KeyError:
          skipped[name] = f"prompt {i}: no timing lines in its output"
          break
      if name in skipped:
        print(f"skipped {name}: {skipped[name]}", flush=True)
        continue
      total = {k: sum(r.get(k, 0) for r in runs)
               for k in ("prompt_tokens", "prompt_s", "tokens",
                         "decode_tokens", "decode_s", "n_drafted",
                         "n_accept")}
      rows[name] = _rates(total["tokens"], total["prompt_s"]
                          + total["decode_s"], total["decode_tokens"],
                          total["decode_s"])
      rows[name]["prompt_tokens_match"] = [
          r["prompt_tokens"] == len(p) for r, p in zip(runs, prompts)]
      if total["n_drafted"]:
        rows[name].update(n_drafted=total["n_drafted"],
                          n_accept=total["n_accept"],
                          accept_rate=total["n_accept"] / total["n_drafted"])
      texts_out[name] = [r["text"] for r in runs]
      print(f"{name}: {rows[name]['tokens_per_s']:.2f} tok/s end to end, "
            f"{rows[name]['decode_tokens_per_s']:.2f} decoding", flush=True)
  for tool in tools:
    if tool in skipped:
      print(f"skipped {tool}: {skipped[tool]}", flush=True)
  return rows, texts_out, skipped, system_info


def _load_llama_cpp(bin_dir: pathlib.Path) -> tuple[Any, str]:
  """llama_cpp, on `bin_dir`'s libllama.so where that exists (unless
  LLAMA_CPP_LIB_PATH says otherwise), or None and why not."""
  if (bin_dir / "libllama.so").exists():
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(bin_dir))
  try:
    import llama_cpp  # pylint: disable=g-import-not-at-top
  except (ImportError, OSError) as e:
    return None, (f"llama-cpp-python not usable ({e}): pip install -e "
                  "'.[peer]' or scripts/build_llamacpp.sh --python")
  return llama_cpp, ""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
  parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                      help="the speculative tools' draft (registry name)")
  parser.add_argument("--n", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--gamma", type=int, default=8)
  parser.add_argument("--num_pred", default="2,4,10",
                      help="llama-cpp-python's prompt lookup lengths ('' "
                      "for none)")
  parser.add_argument("--quantize", default="fp32,gguf,gguf:a8",
                      help="specjax's models: fp32, gguf (the file's "
                      "blocks), gguf:a8 (and int8 activations)")
  parser.add_argument("--llamacpp_bin", default=str(
      pathlib.Path.home() / ".cache/specjax/llamacpp"),
                      help="scripts/build_llamacpp.sh's folder")
  parser.add_argument("--tools", default=",".join(TOOLS),
                      help="llama.cpp programs to run ('' for none)")
  parser.add_argument("--draft_max", default="4,8,16",
                      help="--spec-draft-n-max values (speculative tools "
                      "and lookup)")
  parser.add_argument("--draft_p_min", default="0.75",
                      help="--spec-draft-p-min values (speculative tools)")
  parser.add_argument("--omp_wait_policy", default="",
                      help="OMP_WAIT_POLICY for llama.cpp's OpenMP threads "
                      "(passive where other processes share the cores: "
                      "spinning threads then wait on descheduled ones)")
  parser.add_argument("--python_peer", default=True,
                      action=argparse.BooleanOptionalAction,
                      help="also run llama-cpp-python's modes")
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  bin_dir = pathlib.Path(args.llamacpp_bin).expanduser()
  if args.omp_wait_policy:  # before libgomp loads, and for the tools
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
  llama_cpp, no_python = (_load_llama_cpp(bin_dir) if args.python_peer
                          else (None, "--nopython_peer"))
  if no_python:
    print(f"skipped llama-cpp-python: {no_python}", flush=True)

  config = llama_pair.get_config()
  config.num_prompts = args.n
  tokenizer = registry.load_tokenizer(args.target)
  _, prompts = pair_lib.encode_prompts(config, tokenizer)
  texts = [tokenizer.decode(p) for p in prompts]
  eos = tuple(tokenizer.eos_ids)
  target_path = str(weights.gguf_path(args.target))

  tools = [t for t in args.tools.split(",") if t]
  programs, tool_texts, skipped, system_info = tool_rows(
      bin_dir, tools, target_path, str(weights.gguf_path(args.draft)),
      texts, prompts, args.tokens, args.threads,
      [int(k) for k in args.draft_max.split(",")],
      [float(p) for p in args.draft_p_min.split(",")], out / "logs")
  bindings, python_tokens, prompt_ids_match = {}, [], None
  if llama_cpp is not None:
    bindings, python_tokens = llamacpp_rows(
        target_path, prompts, eos, args.tokens, args.threads,
        [int(k) for k in args.num_pred.split(",") if k])
    # The tools tokenize the text: does the same vocabulary give our ids?
    vocab = llama_cpp.Llama(model_path=target_path, vocab_only=True,
                            verbose=False)
    prompt_ids_match = [vocab.tokenize(t.encode(), add_bos=False,
                                       special=True) == list(p)
                        for t, p in zip(texts, prompts)]
  spec, spec_tokens = specjax_rows(args.target, prompts, eos, args.tokens,
                                   args.gamma,
                                   [q for q in args.quantize.split(",") if q])
  peer = {**bindings, **programs}
  rows = {**spec, **peer}
  build_info = bin_dir / "BUILD_INFO"
  result = {
      "machine": hardware.machine(), "python": platform.python_version(),
      "jax": jax.__version__,
      "llama_cpp_python": llama_cpp.__version__ if llama_cpp else None,
      "llamacpp_bin": str(bin_dir),
      "llamacpp_build": (build_info.read_text().splitlines()
                         if build_info.exists() else None),
      "llamacpp_system_info": system_info, "amx": AMX_NOTE,
      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
      "skipped": {**skipped, **({"llama-cpp-python": no_python}
                                if no_python else {})},
      "target": args.target, "draft": args.draft, "prompts": len(prompts),
      "max_new_tokens": args.tokens, "threads": args.threads,
      "prompt_ids_match_llamacpp_tokenizer": prompt_ids_match,
      "rows": rows,
  }
  if peer and spec:
    best_peer = max(peer.values(), key=lambda r: r["decode_tokens_per_s"])
    best_spec = max(spec.values(), key=lambda r: r["decode_tokens_per_s"])
    result["best_specjax_over_best_llamacpp_decode"] = (
        best_spec["decode_tokens_per_s"] / best_peer["decode_tokens_per_s"])
    result["best_specjax_over_best_llamacpp_end_to_end"] = (
        max(r["tokens_per_s"] for r in spec.values())
        / max(r["tokens_per_s"] for r in peer.values()))
  # Where each llama.cpp mode's greedy output first parts from each
  # quantized specjax model's: as tokens (llama-cpp-python) or as text
  # (the tools), an index into specjax's tokens; None where they agree.
  result["first_difference_from_llamacpp"] = {
      name: [metrics.first_difference(a, b)
             for a, b in zip(tokens, python_tokens)]
      for name, tokens in spec_tokens.items()} if python_tokens else {}
  result["first_text_difference_from_llamacpp_tools"] = {
      quantize: {name: [text_first_difference(tokenizer, ids, text, eos)
                        for ids, text in zip(tokens, mode_texts)]
                 for name, mode_texts in tool_texts.items()}
      for quantize, tokens in spec_tokens.items()}
  (out / "results.json").write_text(json.dumps(result, indent=2))
  print("figures under load from other processes where the machine is "
        "shared")
  print(f"{'mode':52s} {'tok/s e2e':>10s} {'tok/s decode':>13s}")
  for name, row in rows.items():
    print(f"{name:52s} {row['tokens_per_s']:10.2f} "
          f"{row['decode_tokens_per_s']:13.2f}")
  for name, reason in result["skipped"].items():
    print(f"skipped {name}: {reason}")
  print("first differences:", result["first_difference_from_llamacpp"])
  print("first text differences:",
        result["first_text_difference_from_llamacpp_tools"])


if __name__ == "__main__":
  main()
