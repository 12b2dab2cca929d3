"""Training drafting heads by self-distillation, with optax and orbax.

Shape letters (`specjax.shapes`): N sequences, T tokens per sequence, E
hidden, V vocab, K heads; b sequences per training step.

Labels are the target's own next-token distributions (self-distillation,
as in Medusa-2, Cai et al. 2024, and EAGLE, Li et al. 2024), computed from
the cached hidden states through the target's frozen LM head.

- Medusa (`kind="medusa"`): head k at position t is trained towards
  softmax(lm_head(h_{t+k})), the target's law of token t+1+k, by KL
  divergence, with head weights decay^(k-1) (Medusa's 0.8).
- EAGLE (`kind="eagle"`): from the pairs (h_t, e(x_{t+1})), with uniform
  noise of half-width `noise` added to h_t (EAGLE's 0.1), the layer
  predicts h_{t+1}; the loss is the smooth L1 distance to it plus
  `cls_weight` (EAGLE's 0.1) times the KL divergence of the token laws
  the two give through the LM head.

Accuracy is top-1 agreement with the target's own greedy token at the
predicted position (one figure per Medusa head; one for EAGLE).

The optimiser is AdamW under linear warmup and cosine decay, after global
norm clipping (`optax`). Batches are drawn from a permutation per epoch
seeded by (seed, epoch), so a run resumed from its last checkpoint sees
the same batches, and ends with the same parameters, as one that was never
interrupted. Checkpoints are an orbax `CheckpointManager` directory (the
last `keep` steps): the train state, and as JSON the heads' shapes, the
target they were trained for and the metrics so far. `load_heads` restores
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

from specjax import _optional
from specjax.heads.eagle import Eagle
from specjax.heads.eagle import EagleLayer
from specjax.heads.eagle import layer_cache
from specjax.heads.medusa import Medusa
from specjax.heads.medusa import MedusaHeads
from specjax.models import MatmulPlan
from specjax.models import quantized

__all__ = ["CheckpointError", "KINDS", "Split", "TrainConfig", "TrainState",
           "batch_indices", "evaluate", "fit", "load_heads", "recipe",
           "save_plot"]


class CheckpointError(ValueError):
  """A heads checkpoint that is missing, corrupt, partial or for another
  model."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Hyper-parameters (see `configs/train_heads.py` for the defaults)."""

  kind: str = "medusa"
  num_heads: int = 3
  depth: int = 1
  batch_size: int = 4
  num_steps: int = 200
  learning_rate: float = 1e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  loss_decay: float = 0.8
  cls_weight: float = 0.1
  noise: float = 0.1
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


def _kl(teacher: jax.Array, student: jax.Array) -> jax.Array:
  """KL(softmax(teacher) || softmax(student)) over the last axis."""
  log_p = jax.nn.log_softmax(teacher, axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - jax.nn.log_softmax(student, -1)),
                 -1)


def _agree(teacher: jax.Array, student: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(student, -1) == jnp.argmax(teacher, -1))


@dataclasses.dataclass(frozen=True)
class _Medusa:
  """Medusa heads: params, loss and drafter."""

  module: MedusaHeads
  config: TrainConfig

  def init(self, key: jax.Array) -> Any:
    return self.module.init(key, jnp.zeros((1, self.module.hidden_size))
                            )["params"]

  def metrics(self, params, target, tokens, hidden, key):
    """Loss and {"loss": [K] KL, "accuracy": [K]} on hidden [b, T, E]."""
    del tokens, key
    teacher = jax.lax.stop_gradient(target.logits(hidden))  # [b, T, V]
    features = self.module.apply({"params": params}, hidden)  # [b,T,K,E]
    losses, accuracies = [], []
    for k in range(1, self.module.num_heads + 1):
      student = target.logits(features[:, :-k, k - 1])  # [b, T-k, V]
      losses.append(jnp.mean(_kl(teacher[:, k:], student)))
      accuracies.append(_agree(teacher[:, k:], student))
    losses = jnp.stack(losses)
    weights = self.config.loss_decay ** jnp.arange(self.module.num_heads,
                                                   dtype=jnp.float32)
    return jnp.sum(weights * losses), {"loss": losses,
                                       "accuracy": jnp.stack(accuracies)}

  def drafter(self, target, params) -> Medusa:
    return Medusa(target=target, params=params,
                  num_heads=self.module.num_heads, depth=self.module.depth)


@dataclasses.dataclass(frozen=True)
class _Eagle:
  """An EAGLE layer: params, loss and drafter."""

  module: EagleLayer
  config: TrainConfig

  def init(self, key: jax.Array) -> Any:
    e = self.module.config.hidden_size
    return self.module.init(key, jnp.zeros((1, 1, e)), jnp.zeros((1, 1, e)),
                            layer_cache(self.module.config, 1, 1))["params"]

  def metrics(self, params, target, tokens, hidden, key):
    """Loss and {"loss": [1] KL, "accuracy": [1]} on tokens [b, T] and
    hidden [b, T, E]: pairs (h_t + noise, e(x_{t+1})) predict h_{t+1}."""
    inputs = hidden[:, :-1]
    if key is not None:
      inputs = inputs + self.config.noise * jax.random.uniform(
          key, inputs.shape, inputs.dtype, -1.0, 1.0)
    embeddings = quantized.take(target.params["embed"], tokens[:, 1:])
    predicted, _ = self.module.apply(
        {"params": params}, inputs, embeddings.astype(inputs.dtype),
        layer_cache(self.module.config, *tokens[:, 1:].shape), True)
    truth = hidden[:, 1:]
    regression = jnp.mean(optax.huber_loss(predicted, truth, delta=1.0))
    teacher = jax.lax.stop_gradient(target.logits(truth))
    student = target.logits(predicted)
    kl = jnp.mean(_kl(teacher, student))
    return regression + self.config.cls_weight * kl, {
        "loss": kl[None], "accuracy": _agree(teacher, student)[None]}

  def drafter(self, target, params) -> Eagle:
    return Eagle(target=target, params=params)


KINDS = ("medusa", "eagle")


def recipe(target: Any, config: TrainConfig) -> _Medusa | _Eagle:
  """What `config.kind` trains, for `target` (float32 parameters)."""
  if config.kind == "medusa":
    return _Medusa(MedusaHeads(config.num_heads, target.config.hidden_size,
                               config.depth, param_dtype=jnp.float32), config)
  if config.kind == "eagle":
    return _Eagle(EagleLayer(target.config, jnp.float32), config)
  raise ValueError(f"kind must be one of {KINDS}, got {config.kind!r}.")


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


# Compiled once per recipe (static, hashable) and shapes, not per call.
_eval_step = jax.jit(lambda what, p, t, x, h: what.metrics(p, t, x, h, None)[1],
                     static_argnums=0)


def evaluate(what: _Medusa | _Eagle, params: Any, target: Any,
             data: Split, batch: int) -> dict[str, list[float]]:
  """Per-head KL and top-1 accuracy over a held-out split (means over
  batches of `batch` sequences; no noise)."""
  totals = []
  for start in range(0, len(data.hidden), batch):
    totals.append(_eval_step(what, params, target,
                      jnp.asarray(data.tokens[start:start + batch]),
                      jnp.asarray(data.hidden[start:start + batch],
                                  jnp.float32)))
  return {name: np.mean([np.asarray(t[name]) for t in totals], 0).tolist()
          for name in ("loss", "accuracy")}


def _shapes(target: Any) -> dict[str, int]:
  """The target dimensions heads depend on."""
  c = target.config
  return {"hidden_size": int(c.hidden_size), "vocab_size": int(c.vocab_size),
          "num_heads": int(c.num_heads), "num_kv_heads": int(c.num_kv_heads),
          "head_dim": int(c.head_dim),
          "intermediate_size": int(c.intermediate_size)}


@dataclasses.dataclass(frozen=True)
class Split:
  """tokens [N, T] int32 and the target's hidden states [N, T, E] there."""

  tokens: np.ndarray
  hidden: np.ndarray


def fit(target: Any, train: Split, val: Split, config: TrainConfig,
        workdir: str | os.PathLike, *, target_name: str = "",
        stop_at: int | None = None,
        progress: Callable[[int, dict[str, float]], None] | None = None
        ) -> tuple[Any, list[dict[str, Any]]]:
  """Trains `config.kind` heads on a split's hidden states (`data`).

  Resumes from the latest checkpoint in `workdir/checkpoints` if any.

  Args:
    target: the `Model` whose LM head labels and decodes the heads.
    train: the training split.
    val: the held-out split (evaluated at step 0, every `eval_every` steps
      and at the end).
    config: hyper-parameters.
    workdir: checkpoints go here.
    target_name: recorded with the checkpoint.
    stop_at: stop after this step (simulates an interruption); None runs
      to `config.num_steps`.
    progress: called after each step with (step, metrics).

  Returns:
    The heads' params and the history: the held-out scores at step 0,
    then one dict per step (train loss and accuracy, and `val_*` when
    evaluated).
  """
  target = _trainable(target)
  what = recipe(target, config)
  tx = _optimizer(config)
  params = what.init(jax.random.key(config.seed))
  state = TrainState(step=jnp.int32(0), params=params,
                     opt_state=tx.init(params))
  manager = ocp.CheckpointManager(
      pathlib.Path(workdir).absolute() / "checkpoints",
      options=ocp.CheckpointManagerOptions(max_to_keep=config.keep,
                                           create=True))
  meta = {"kind": config.kind, "shapes": _shapes(target),
          "target": target_name, "config": dataclasses.asdict(config)}
  history: list[dict[str, Any]] = []
  if manager.latest_step() is not None:
    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore()))
    state, history = restored.state, restored.meta["history"]
  else:  # where training starts from
    scores = evaluate(what, state.params, target, val, config.batch_size)
    history.append({"step": 0, "val_loss": scores["loss"],
                    "val_accuracy": scores["accuracy"]})
  noise_key = jax.random.key(config.seed + 1)

  @jax.jit
  def train_step(state, target, tokens, hidden):
    key = jax.random.fold_in(noise_key, state.step)
    grad_fn = jax.value_and_grad(
        lambda p: what.metrics(p, target, tokens, hidden, key), has_aux=True)
    (loss, metrics), grads = grad_fn(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1,
                      params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), dict(metrics, total=loss)

  last = config.num_steps if stop_at is None else min(stop_at,
                                                      config.num_steps)
  for step in range(int(state.step), last):
    rows = batch_indices(step, len(train.hidden), config.batch_size,
                         config.seed)
    state, metrics = train_step(state, target, jnp.asarray(train.tokens[rows]),
                                jnp.asarray(train.hidden[rows], jnp.float32))
    done = step + 1
    record = {"step": done, "loss": float(metrics["total"]),
              "accuracy": np.asarray(metrics["accuracy"]).tolist()}
    if done % config.eval_every == 0 or done == config.num_steps:
      scores = evaluate(what, state.params, target, val, config.batch_size)
      record.update(val_loss=scores["loss"], val_accuracy=scores["accuracy"])
    if progress is not None:
      progress(done, record)
    history.append(record)
    if "val_loss" in record or done % config.save_every == 0 or done == last:
      manager.save(done, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          meta=ocp.args.JsonSave(dict(meta, history=history))))
  manager.wait_until_finished()
  manager.close()
  return state.params, history


def load_heads(path: str | os.PathLike, target: Any,
               step: int | None = None) -> Medusa | Eagle:
  """The drafter (`Medusa` or `Eagle`) of a `fit` checkpoint directory
  (its latest step, or `step`) for `target`.

  Raises:
    CheckpointError: no checkpoint there, a corrupt or partial one, or
      heads trained for another model (both models' shapes named).
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
    config = TrainConfig(**meta["config"])
  except Exception as e:  # orbax raises several types for bad files
    raise CheckpointError(f"Heads checkpoint {directory} step {step} is "
                          f"corrupt or partial (metadata): {e}") from e
  want, got = _shapes(target), meta.get("shapes", {})
  if got != want:
    describe = lambda d: (f"hidden size {d.get('hidden_size')} and "
                          f"vocabulary {d.get('vocab_size')}")
    raise CheckpointError(
        f"Heads at {directory} were trained for a model with "
        f"{describe(got)} (target {meta.get('target')!r}, {got}), but this "
        f"target has {describe(want)} ({want}).")
  what = recipe(target, config)
  abstract = jax.eval_shape(lambda: what.init(jax.random.key(0)))
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
  return what.drafter(target, params)


def save_plot(history: list[dict[str, Any]], path: str | os.PathLike
              ) -> None:
  """Training loss and held-out per-head accuracy against step, as PNG."""
  matplotlib = _optional.require("matplotlib", "experiments")
  matplotlib.use("Agg")
  plt = _optional.require("matplotlib.pyplot", "experiments")
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  trained = [r for r in history if "loss" in r]
  left.plot([r["step"] for r in trained], [r["loss"] for r in trained],
            label="train (weighted sum over heads)", alpha=0.6)
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
