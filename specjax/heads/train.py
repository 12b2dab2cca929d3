"""Training Medusa heads by self-distillation, with optax and orbax.

Shape letters (`specjax.shapes`): N sequences, T tokens per sequence, E
hidden, V vocab, K heads; b sequences per training step.

Labels are the target's own next-token distributions (Medusa-2's
self-distillation, Cai et al. 2024), computed from the cached hidden
states through the target's frozen LM head: head k at position t is
trained towards softmax(lm_head(h_{t+k})), the target's distribution of
token t+1+k, by KL divergence, with head weights decay^(k-1) (Medusa's
0.8). Accuracy is top-1 agreement with the target's own greedy token there.

The optimiser is AdamW under linear warmup and cosine decay, after global
norm clipping (`optax`). Batches are drawn from a permutation per epoch
seeded by (seed, epoch), so a run resumed from its last checkpoint sees
the same batches, and ends with the same parameters, as one that was never
interrupted. Checkpoints are an orbax `CheckpointManager` directory (the
last `keep` steps): the train state, and as JSON the heads' shapes, the
target they were trained for and the metrics so far. `load_medusa` restores
heads for inference and refuses heads trained for another model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from specjax.heads.medusa import Medusa
from specjax.heads.medusa import MedusaHeads
from specjax.models import MatmulPlan

__all__ = ["CheckpointError", "TrainConfig", "TrainState", "batch_indices",
           "evaluate", "fit", "head_metrics", "load_medusa", "save_plot"]


class CheckpointError(ValueError):
  """A heads checkpoint that is missing, corrupt, partial or for another
  model."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Hyper-parameters (see `configs/train_heads.py` for the defaults)."""

  num_heads: int = 3
  depth: int = 1
  batch_size: int = 4
  num_steps: int = 200
  learning_rate: float = 1e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  loss_decay: float = 0.8
  seed: int = 0
  eval_every: int = 50
  save_every: int = 50
  keep: int = 2


@flax.struct.dataclass
class TrainState:
  """step [] int32, the heads' params and the optimiser state."""

  step: jax.Array
  params: Any
  opt_state: Any


def _optimizer(config: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=max(config.warmup_steps, 1),
      decay_steps=max(config.num_steps, config.warmup_steps + 1),
      end_value=config.learning_rate * 0.1)
  return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                     optax.adamw(schedule, weight_decay=config.weight_decay))


def _module(target: Any, config: TrainConfig) -> MedusaHeads:
  return MedusaHeads(config.num_heads, target.config.hidden_size,
                     config.depth, param_dtype=jnp.float32)


def head_metrics(module: MedusaHeads, params: Any, target: Any,
                 hidden: jax.Array, decay: float
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Loss and per-head metrics on hidden [b, T, E].

  Returns:
    The weighted loss, and {"loss": [K] KL per head, "accuracy": [K]
    top-1 agreement with the target's greedy token}.
  """
  teacher = jax.lax.stop_gradient(target.logits(hidden))  # [b, T, V]
  features = module.apply({"params": params}, hidden)  # [b, T, K, E]
  losses, accuracies = [], []
  for k in range(1, module.num_heads + 1):
    student = target.logits(features[:, :-k, k - 1])  # [b, T-k, V]
    p = jax.nn.softmax(teacher[:, k:], axis=-1)
    log_p = jax.nn.log_softmax(teacher[:, k:], axis=-1)
    kl = jnp.sum(p * (log_p - jax.nn.log_softmax(student, axis=-1)), -1)
    losses.append(jnp.mean(kl))
    accuracies.append(jnp.mean(
        jnp.argmax(student, -1) == jnp.argmax(teacher[:, k:], -1)))
  losses = jnp.stack(losses)
  weights = decay ** jnp.arange(module.num_heads, dtype=jnp.float32)
  return jnp.sum(weights * losses), {"loss": losses,
                                     "accuracy": jnp.stack(accuracies)}


def batch_indices(step: int, num: int, batch: int, seed: int) -> np.ndarray:
  """[batch] sequence indices of a training step: consecutive slices of a
  permutation drawn per epoch from (seed, epoch)."""
  per_epoch = max(num // batch, 1)
  epoch, index = divmod(step, per_epoch)
  order = np.random.default_rng([seed, epoch]).permutation(num)
  return order[index * batch:(index + 1) * batch]


def _trainable(target: Any) -> Any:
  """The target with XLA products (the CPU kernel has no gradient)."""
  if getattr(target, "plan", MatmulPlan()).kernel:
    return target.with_plan(MatmulPlan(layout=target.plan.layout))
  return target


def evaluate(module: MedusaHeads, params: Any, target: Any,
             hidden: np.ndarray, batch: int, decay: float
             ) -> dict[str, list[float]]:
  """Per-head KL and top-1 accuracy over held-out hidden states [N, T, E]
  (means over batches of `batch` sequences)."""
  run = jax.jit(lambda p, t, h: head_metrics(module, p, t, h, decay)[1])
  totals = []
  for start in range(0, len(hidden), batch):
    totals.append(run(params, target,
                      jnp.asarray(hidden[start:start + batch], jnp.float32)))
  return {name: np.mean([np.asarray(t[name]) for t in totals], 0).tolist()
          for name in ("loss", "accuracy")}


def _meta(target: Any, config: TrainConfig, target_name: str) -> dict:
  return {"kind": "medusa", "num_heads": config.num_heads,
          "depth": config.depth,
          "hidden_size": int(target.config.hidden_size),
          "vocab_size": int(target.vocab_size), "target": target_name,
          "config": dataclasses.asdict(config)}


def fit(target: Any, train: np.ndarray, val: np.ndarray, config: TrainConfig,
        workdir: str | os.PathLike, *, target_name: str = "",
        stop_at: int | None = None,
        progress: Callable[[int, dict[str, float]], None] | None = None
        ) -> tuple[Any, list[dict[str, Any]]]:
  """Trains heads on hidden states [N, T, E] (`data.extract`).

  Resumes from the latest checkpoint in `workdir/checkpoints` if any.

  Args:
    target: the `Model` whose LM head labels and decodes the heads.
    train: [N, T, E] training hidden states.
    val: [M, T, E] held-out hidden states (evaluated every `eval_every`
      steps and at the end).
    config: hyper-parameters.
    workdir: checkpoints and `history.json` go here.
    target_name: recorded with the checkpoint.
    stop_at: stop after this step (simulates an interruption); None runs
      to `config.num_steps`.
    progress: called after each step with (step, metrics).

  Returns:
    The heads' params and the history: the held-out scores at step 0,
    then one dict per step that evaluated or checkpointed (train loss and
    accuracy, and `val_*` when evaluated).
  """
  target = _trainable(target)
  module = _module(target, config)
  tx = _optimizer(config)
  params = module.init(jax.random.key(config.seed),
                       jnp.zeros((1, target.config.hidden_size)))["params"]
  state = TrainState(step=jnp.int32(0), params=params,
                     opt_state=tx.init(params))
  manager = ocp.CheckpointManager(
      pathlib.Path(workdir).absolute() / "checkpoints",
      options=ocp.CheckpointManagerOptions(max_to_keep=config.keep,
                                           create=True))
  meta = _meta(target, config, target_name)
  history: list[dict[str, Any]] = []
  if manager.latest_step() is not None:
    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore()))
    state, history = restored.state, restored.meta["history"]
  else:  # where training starts from: heads at the identity
    scores = evaluate(module, state.params, target, val, config.batch_size,
                      config.loss_decay)
    history.append({"step": 0, "val_loss": scores["loss"],
                    "val_accuracy": scores["accuracy"]})

  @jax.jit
  def train_step(state, target, hidden):
    grad_fn = jax.value_and_grad(
        lambda p: head_metrics(module, p, target, hidden, config.loss_decay),
        has_aux=True)
    (loss, metrics), grads = grad_fn(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1,
                      params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), dict(metrics, total=loss)

  last = config.num_steps if stop_at is None else min(stop_at,
                                                      config.num_steps)
  for step in range(int(state.step), last):
    rows = batch_indices(step, len(train), config.batch_size, config.seed)
    state, metrics = train_step(state, target,
                                jnp.asarray(train[rows], jnp.float32))
    done = step + 1
    record = {"step": done, "loss": float(metrics["total"]),
              "accuracy": np.asarray(metrics["accuracy"]).tolist()}
    if done % config.eval_every == 0 or done == config.num_steps:
      scores = evaluate(module, state.params, target, val,
                        config.batch_size, config.loss_decay)
      record.update(val_loss=scores["loss"], val_accuracy=scores["accuracy"])
    if progress is not None:
      progress(done, record)
    if "val_loss" in record or done % config.save_every == 0 or done == last:
      history.append(record)
      manager.save(done, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          meta=ocp.args.JsonSave(dict(meta, history=history))))
  manager.wait_until_finished()
  manager.close()
  return state.params, history


def load_medusa(path: str | os.PathLike, target: Any,
                step: int | None = None) -> Medusa:
  """The `Medusa` drafter of a `fit` checkpoint directory (its latest
  step, or `step`) for `target`.

  Raises:
    CheckpointError: no checkpoint there, a corrupt or partial one, or
      heads trained for another hidden size or vocabulary (both shapes
      named).
  """
  directory = pathlib.Path(path).absolute()
  directory = directory / "checkpoints" if (
      directory / "checkpoints").is_dir() else directory
  if not directory.is_dir():
    raise CheckpointError(f"No heads checkpoint directory at {directory}.")
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"{directory} holds no finished checkpoint step.")
  try:
    meta = manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta
  except Exception as e:  # orbax raises several types for bad files
    raise CheckpointError(f"Heads checkpoint {directory} step {step} is "
                          f"corrupt or partial (metadata): {e}") from e
  want = (int(target.config.hidden_size), int(target.vocab_size))
  got = (meta.get("hidden_size"), meta.get("vocab_size"))
  if meta.get("kind") != "medusa" or got != want:
    raise CheckpointError(
        f"Heads at {directory} were trained for a model with hidden size "
        f"{got[0]} and vocabulary {got[1]} (target {meta.get('target')!r}), "
        f"but this target has hidden size {want[0]} and vocabulary "
        f"{want[1]}.")
  config = TrainConfig(**meta["config"])
  module = _module(target, config)
  abstract = jax.eval_shape(
      lambda: module.init(jax.random.key(0),
                          jnp.zeros((1, want[0])))["params"])
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item={"params": abstract},
            restore_args={"params": jax.tree.map(
                lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                abstract)},
            partial_restore=True)))
    params = restored.state["params"]
  except Exception as e:  # orbax raises several types for bad files
    raise CheckpointError(f"Heads checkpoint {directory} step {step} is "
                          f"corrupt or partial: {e}") from e
  manager.close()
  params = jax.tree.map(lambda x: jnp.asarray(x, target.dtype), params)
  return Medusa(target=target, params=params, num_heads=config.num_heads,
                depth=config.depth)


def save_plot(history: list[dict[str, Any]], path: str | os.PathLike
              ) -> None:
  """Training loss and held-out per-head accuracy against step, as PNG."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  trained = [r for r in history if "loss" in r]
  left.plot([r["step"] for r in trained], [r["loss"] for r in trained],
            label="train")
  evals = [r for r in history if "val_loss" in r]
  if evals:
    left.plot([r["step"] for r in evals],
              [np.mean(r["val_loss"]) for r in evals],
              "o-", label="held-out (mean KL per head)")
    for k in range(len(evals[0]["val_accuracy"])):
      right.plot([r["step"] for r in evals],
                 [r["val_accuracy"][k] for r in evals], "o-",
                 label=f"head {k + 1}")
  left.set(xlabel="step", ylabel="loss", title="self-distillation loss")
  right.set(xlabel="step", ylabel="top-1 vs target greedy",
            title="held-out accuracy", ylim=(0, 1))
  left.legend()
  right.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
