"""Loading what an experiment config names: the pair, its drafters,
tokenizer and prompts.

`load_pair(config)` loads the target, the draft where a configured drafter
drafts with it (`needs_draft`), and their shared tokenizer
(`specjax.registry`, or random tiny models for `tiny`), `make_drafter`
builds a named drafter from them (`configs/llama_pair.py`'s `drafter=`),
and `encode_prompts` turns the config's prompt set into token ids. The
experiments (`experiments.bench`, `experiments.crossover`) and the
notebooks share them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from experiments import learned
from experiments import prompts as prompts_lib
from experiments.validation import ConfigError
from experiments.validation import drafter_kind
from experiments.validation import parse_mesh
from experiments.validation import split_jump
from specjax import drafters
from specjax import hardware
from specjax import models
from specjax import registry
from specjax import sharding
from specjax import testing
from specjax.cpu import plans as tuning
from specjax.cpu import quantize as cpu_quantize
from specjax.heads import train as heads_train
from specjax.models import quantized
from specjax.sharding import memory

__all__ = ["Pair", "default_skip", "drafter_names", "encode_prompts",
           "load_pair", "make_drafter", "make_mesh", "matmul_info",
           "memory_plan", "model_info", "needs_draft", "tune_rows",
           "workload"]

# Drafter kinds that draft with the pair's draft model (`config.draft`).
MODEL_DRAFTERS = ("model", "fallback", "cascade")


@dataclasses.dataclass
class Pair:
  """A loaded (target, draft) pair and their shared tokenizer.

  Attributes:
    target: the verifying `LanguageModel`.
    draft: the drafting `LanguageModel` (may be `target` itself), or None
      where no drafter the config runs drafts with a model (`needs_draft`).
    tokenizer: shared tokenizer (`specjax.tokenizer.Tokenizer`, or
      `prompts.ByteTokenizer` for tiny models).
    load_s: seconds spent loading.
    quantize: with `config.quantize="auto"`, what it resolved to for the
      target and why (`registry.auto_quantize`, as JSON); else None.
  """

  target: Any
  draft: Any
  tokenizer: Any
  load_s: float = 0.0
  quantize: dict[str, Any] | None = None


def load_pair(config: Any) -> Pair:
  """Loads target, draft and tokenizer as the config says.

  `tiny` builds random tiny models (`specjax.testing.tiny_pair`) with the
  byte-level stand-in tokenizer; anything else goes through
  `specjax.registry.load_pretrained` (registry names, local directories,
  Hub ids). The draft is loaded only where a drafter the config runs
  drafts with it (`needs_draft`): prompt lookup, the target's own layers
  and trained heads leave `Pair.draft` None.

  Raises:
    ConfigError: the draft's vocabulary differs from the target's.
  """
  start = time.perf_counter()
  dtype = hardware.resolve_dtype(config.dtype)
  rows = tune_rows(config)
  mesh = make_mesh(config)
  quantize = config.get("quantize") or None
  choice = None
  wanted = needs_draft(config)
  if config.target == "tiny":
    tokenizer = prompts_lib.ByteTokenizer()
    target, draft = testing.tiny_pair(config.seed, tokenizer.vocab_size,
                                      dtype=dtype)
    if quantize and quantize != "auto":  # random weights: no GGUF blocks
      target = target.quantize(quantize)
    target, _ = tuning.apply(target, config.matmul, rows=rows,
                             cache_dir=config.cache_dir or None)
    if not wanted or config.draft == "same":
      draft = None
    else:
      if config.get("draft_quantize"):
        draft = draft.quantize(config.draft_quantize)
      draft, _ = tuning.apply(draft, config.matmul, rows=rows,
                              cache_dir=config.cache_dir or None)
  else:
    load = functools.partial(registry.load_pretrained, dtype=dtype,
                             cache_dir=config.cache_dir or None,
                             progress=config.progress, matmul=config.matmul,
                             tune_rows=rows, mesh=mesh)
    if quantize == "auto":
      choice = registry.auto_quantize(
          config.target, dtype, cache_dir=config.cache_dir or None,
          progress=config.progress, matmul=config.matmul, tune_rows=rows,
          mesh=mesh, workload=workload(config))
      logging.info("quantize=auto: %s", choice.why)
      quantize, choice = choice.quantize, choice.to_json()
    logging.info("Loading target %s (%s)", config.target, dtype)
    target, tokenizer = load(config.target, quantize=quantize)
    draft = None
    if wanted and config.draft != "same":
      logging.info("Loading draft %s (%s)", config.draft, dtype)
      draft, _ = load(config.draft, split=config.draft_split,
                      quantize=config.get("draft_quantize") or None)
  if config.draft == "same":
    draft = _same(config, target, load if config.target != "tiny"
                  else None) if wanted else None
  elif mesh is not None:  # the tiny pair; loaders placed the others
    target = sharding.shard(target, mesh)
    if draft is not None:
      draft = sharding.shard(draft, mesh, split=config.draft_split)
  if draft is not None and draft.vocab_size != target.vocab_size:
    raise ConfigError(
        f"config.draft {config.draft!r} has a vocabulary of "
        f"{draft.vocab_size} ids but config.target {config.target!r} has "
        f"{target.vocab_size}; speculative decoding needs a shared "
        "tokenizer.")
  return Pair(target, draft, tokenizer, time.perf_counter() - start, choice)


def needs_draft(config: Any) -> bool:
  """Whether a drafter the config runs (`drafter_names`) drafts with the
  draft model: `model`, `fallback` and `cascade`, alone or after `jump+`.
  The rest (lookup, the target's own layers, trained heads) need none, so
  the default job, prompt lookup, loads no second model."""
  return any(drafter_kind(name)[0] in MODEL_DRAFTERS
             for name in drafter_names(config))


def _same(config: Any, target: Any, load: Any) -> Any:
  """`draft=same`: the target itself (α = 1), or with `draft_quantize` a
  quantized copy of the target's own weights (QSpec-style
  self-speculation: no second model, no training). The copy has its own
  parameters and, as a draft, its own cache, so the target is untouched
  and speculation stays exact. `gguf` reads the target's GGUF file's own
  blocks (`load`: the pair's loader; None for the tiny pair). With
  `draft_experts` = k, that draft routes each token to its top k experts
  (`models.moe.fewer_experts`: a mixture of experts' own arrays, shared).

  Raises:
    ConfigError: `draft_quantize=gguf` without a GGUF target, or
      `draft_experts` for a dense target or outside [1, the target's k).
  """
  spec = config.get("draft_quantize")
  if not spec:
    draft = target
  elif quantized.split_activations(spec)[0] == "gguf":
    if load is None:
      raise ConfigError(f"config.draft_quantize={spec!r} needs a GGUF "
                        f"target (config.target={config.target!r}).")
    logging.info("Loading the target's GGUF blocks as its draft")
    draft = load(config.target, quantize=spec)[0]
  else:
    draft = target.quantize(spec)
  experts = config.get("draft_experts", 0)
  if not experts:
    return draft
  try:
    return models.moe.fewer_experts(draft, experts)
  except ValueError as e:
    raise ConfigError(f"config.draft_experts={experts!r} for "
                      f"config.target={config.target!r}: {e}") from e


def make_mesh(config: Any) -> jax.sharding.Mesh | None:
  """The mesh `config.mesh` names over every process's devices, or None.

  Raises:
    ConfigError: its size is not the number of devices.
  """
  if not config.get("mesh"):
    return None
  data, model = parse_mesh(config.mesh)
  if data * model != jax.device_count():
    raise ConfigError(
        f"config.mesh={config.mesh!r} needs {data * model} devices; this "
        f"run has {jax.device_count()} ({jax.process_count()} process(es)).")
  return sharding.make_mesh(data=data, model=model)


def memory_plan(config: Any, pair: Pair, cache_size: int, widest: int,
                prompt_width: int | None = None) -> dict[str, Any]:
  """The weights, caches and widest pass of the largest batch, per device,
  checked against device memory before anything compiles (results.json
  `memory`); `prompt_width`: P of the widest prompt bucket.

  Raises:
    MemoryError: naming the sizes, when a device cannot hold them.
  """
  batch = max(tuple(config.batch_sizes) or (config.batch_size,))
  models = {"target": pair.target}
  if pair.draft is not None:
    models["draft"] = pair.draft
  plan = memory.plan(models, batch=batch, cache_size=cache_size,
                     chunk=widest + 1, prompt_width=prompt_width)
  plan.check()
  return {"table": plan.table(), "per_device_bytes": plan.per_device,
          "limit_bytes": plan.limit, "devices": plan.devices,
          "mesh": config.get("mesh", "")}


def make_drafter(name: str, config: Any, pair: Pair) -> Any:
  """The drafter `name` (`validation.DRAFTERS`, or `early_exit@E`) built
  from the pair; `jump+NAME` is `Fallback(JumpForward(V), NAME's)`: the
  tokens the grammar forces, drafted free, else NAME's proposal."""
  jump, inner = split_jump(name)
  if jump:
    return drafters.Fallback(
        drafters.JumpForward(vocab_size=pair.target.vocab_size),
        make_drafter(inner, config, pair))
  kind, exit_layer = drafter_kind(name)
  lookup = drafters.PromptLookup().for_target(pair.target, pair.tokenizer)
  if kind == "lookup":
    return lookup
  if kind == "fallback":
    return drafters.Fallback(lookup, drafters.DraftModel(pair.draft))
  if kind == "cascade":
    return drafters.Cascade(pair.draft, lookup, config.cascade_gamma)
  if kind == "early_exit":
    return drafters.EarlyExit(pair.target, exit_layer or config.exit_layer
                              or pair.target.config.num_layers // 2)
  if kind in ("medusa", "eagle"):
    path = config[f"{kind}_path"]
    drafter = heads_train.load_heads(path, pair.target)
    if type(drafter).__name__.lower() != kind:
      raise ConfigError(f"config.{kind}_path {path!r} holds "
                        f"{type(drafter).__name__} heads, not {kind}.")
    return drafter
  if kind == "layer_skip":
    return drafters.EarlyExit(pair.target, None, skip=config.skip_layers or
                              default_skip(pair.target.config.num_layers))
  return drafters.DraftModel(pair.draft)


def default_skip(num_layers: int) -> tuple[int, ...]:
  """Layers `layer_skip` leaves out unless told: every other layer of the
  second half (Draft & Verify and SWIFT find that later layers are the
  more redundant; this is a fixed choice, not their search)."""
  return tuple(range(num_layers // 2 + 1, num_layers - 1, 2))


def drafter_names(config: Any) -> tuple[str, ...]:
  """The drafters a run compares: the sweep, else `config.drafter`."""
  return tuple(config.get("drafters", ())) or (config.drafter,)


def workload(config: Any) -> cpu_quantize.Workload:
  """The speculative call the run times, for `quantize="auto"` to price:
  its prompts' mean length (the target's tokenizer alone is loaded), N,
  B and γ, or a tree's T + 1 rows where the config drafts trees, and the
  passes per call an earlier run of the job took (`learned`), if any."""
  tokenizer = registry.load_tokenizer(config.target,
                                      cache_dir=config.cache_dir or None)
  lengths = [len(p) for p in encode_prompts(config, tokenizer)[1]]
  nodes = config.get("num_nodes", 0)
  return cpu_quantize.Workload.decoding(
      batch=config.batch_size, prompt_tokens=sum(lengths) / len(lengths),
      new_tokens=config.max_new_tokens, gamma=config.gamma,
      width=nodes + 1 if nodes else None,
      steps=learned.steps_per_call(config))


def tune_rows(config: Any) -> tuple[int, int]:
  """Rows of the headline decode step and verification pass: B, B(γ+1)."""
  return config.batch_size, config.batch_size * (config.gamma + 1)


def matmul_info(config: Any, model: Any) -> dict[str, Any] | None:
  """The model's matmul plan and the timings it was chosen by (cached)."""
  if not hasattr(model, "plan"):
    return None
  return tuning.tune(model.config, model.dtype, rows=tune_rows(config),
                     matmul=config.matmul,
                     cache_dir=config.cache_dir or None).to_json()


def encode_prompts(config: Any, tokenizer: Any
                   ) -> tuple[prompts_lib.PromptSet, list[list[int]]]:
  """The first `config.num_prompts` prompts, as token ids."""
  if config.prompt_file:
    prompt_set = prompts_lib.load_prompt_file(config.prompt_file,
                                              config.num_prompts)
  else:
    prompt_set = prompts_lib.load_prompts(
        config.prompt_set, config.num_prompts,
        cache_dir=config.cache_dir or None)
  ids = [prompts_lib.encode_prompt(
      tokenizer, p, chat_template=config.chat_template,
      max_prompt_tokens=config.max_prompt_tokens) for p in prompt_set.prompts]
  return prompt_set, ids


def model_info(name: str, model: Any) -> dict[str, Any]:
  """A model's name, config and parameter count (results.json `models`)."""
  info = {"name": name}
  config = getattr(model, "config", None)
  if dataclasses.is_dataclass(config):
    info["config"] = {k: (v if isinstance(v, (int, float, str, bool,
                                               type(None))) else str(v))
                      for k, v in dataclasses.asdict(config).items()}
  params = getattr(model, "params", None)
  if params is not None:
    # A quantized matrix is one leaf of its logical shape here.
    leaves = jax.tree.leaves(params, is_leaf=models.is_quantized)
    info["num_params"] = int(sum(np.prod(x.shape) for x in leaves))
    info["dtype"] = str(leaves[0].dtype)
    info["quantization"] = getattr(model, "quantization", None)
    if hasattr(model, "weight_bytes_per_token"):
      info["weight_bytes_per_token"] = int(model.weight_bytes_per_token)
  return info
