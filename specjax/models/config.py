"""`ModelConfig`: the static description of a Llama- or Gemma-family
transformer, dense or mixture-of-experts.

The config is frozen and hashable, so it can be a static argument of `jax.jit`
(it fixes every shape); parameters live in a separate plain pytree whose layout
`param_shapes` defines once for the module, the loaders and the tests.

Shape letters (`specjax.shapes`): V vocab, E hidden (embedding) size, F MLP
hidden size, L layers, H query heads, K key/value heads, D head dim, X
experts, F_s the shared expert's MLP size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3", "mixtral", "qwen2_moe",
                 "qwen3_moe", "olmoe")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency-dependent rope scaling (`rope_type: llama3`).

  Attributes:
    factor: how much longer the extended context is than the original.
    low_freq_factor: wavelengths above original/low_freq_factor are scaled.
    high_freq_factor: wavelengths below original/high_freq_factor are kept.
    original_max_position_embeddings: the context the model was trained on.
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Linear rope scaling (`rope_type: linear`): positions divided by
  `factor` (Gemma 3's global layers, 4B and up).

  Attributes:
    factor: how much the positions are compressed.
  """

  factor: float


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder: Llama, Mistral, Qwen2, SmolLM, Gemma 3,
  and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

  The Llama family is the default (every Gemma field off). Gemma 3 text
  (`arch="gemma3"`) sets the fields below the line: local (sliding) layers
  interleaved with global ones, each kind with its own rope, RMSNorm on q
  and k per head, norms before and after attention and the MLP with a
  (1 + w) scale, a GeGLU MLP, the embedding scaled by sqrt(E), and
  `query_pre_attn_scalar` in place of D in the attention scale.

  A mixture of experts (`num_experts` > 0) replaces every layer's MLP by X
  gated MLPs of size F (`intermediate_size`) and a router
  (`specjax.models.moe`): each token runs the k experts of highest router
  probability, weighted by those probabilities (renormalised to sum to
  one with `norm_topk_prob`), plus an always-on shared expert gated by a
  sigmoid when `shared_expert_size` > 0 (Qwen2-MoE).

  Attributes:
    arch: one of `ARCHITECTURES`; informational, the math is set by the flags.
    vocab_size: V.
    hidden_size: E.
    intermediate_size: F, the SwiGLU hidden size (of each expert, in a
      mixture of experts).
    num_layers: L.
    num_heads: H, query heads.
    num_kv_heads: K, key/value heads (grouped-query attention when K < H).
    head_dim: D.
    rope_theta: rotary base frequency.
    rope_scaling: Llama 3 or linear rope scaling, or None; with
      `rope_local_theta`, of the global layers only.
    rms_norm_eps: epsilon of every RMSNorm.
    qkv_bias: whether q, k and v projections have a bias (Qwen2).
    tie_embeddings: whether the output projection reuses the input embedding.
    sliding_window: attend only to the last `sliding_window` positions
      (Mistral; Gemma's local layers), or None for full causal attention.
    max_position_embeddings: the longest context the model supports.
    sliding_window_pattern: with `sliding_window`, layer i is global (full
      attention) when (i + 1) % pattern == 0 and local otherwise (Gemma 3:
      6, five local layers to one global); None: every layer slides.
    rope_local_theta: rope base of the local layers, which then use no
      rope scaling (Gemma 3: 10000); None: the same rope as global layers.
    norm_plus_one: RMSNorm scales by (1 + w) in float32 (Gemma) instead
      of w.
    qk_norm: RMSNorm over D on each query and key head before rope
      (parameters `q_norm`, `k_norm` [D]).
    qk_norm_per_head: with `qk_norm`, False normalises the whole q and k
      projections instead (`q_norm` [H*D], `k_norm` [K*D]; OLMoE).
    post_norms: RMSNorm on the attention and MLP outputs before they join
      the residual (`attn_post_norm`, `mlp_post_norm` [E]); `mlp_norm` is
      then Gemma's pre-feed-forward norm.
    activation: the gated MLP's activation, one of `ACTIVATIONS`: "silu"
      (SwiGLU) or "gelu_tanh" (GeGLU, gelu's tanh approximation).
    scale_embeddings: multiply embeddings by sqrt(E), in their dtype.
    query_pre_attn_scalar: attention scores are scaled by this ** -0.5
      instead of D ** -0.5; None: D.
    attn_logit_softcap: scores become cap * tanh(scores / cap) before the
      mask, or None.
    final_logit_softcap: the same on the output logits, or None.
    num_experts: X, experts per layer; 0 for a dense MLP.
    num_experts_per_tok: k, experts each token runs (top-k routing).
    norm_topk_prob: renormalise the k chosen probabilities to sum to one
      (Mixtral always; Qwen-MoE and OLMoE as their config says).
    shared_expert_size: F_s of Qwen2-MoE's shared expert (a gated MLP
      every token runs, scaled by sigmoid of `shared_expert_gate`), or 0.
    router_weights_float32: keep the routing weights in float32 when they
      scale the experts' outputs (Mixtral); False casts them to the
      activations' dtype first (Qwen-MoE, OLMoE).
  """

  arch: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_embeddings: bool = False
  sliding_window: int | None = None
  max_position_embeddings: int = 4096
  sliding_window_pattern: int | None = None
  rope_local_theta: float | None = None
  norm_plus_one: bool = False
  qk_norm: bool = False
  post_norms: bool = False
  activation: str = "silu"
  scale_embeddings: bool = False
  query_pre_attn_scalar: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  qk_norm_per_head: bool = True
  num_experts: int = 0
  num_experts_per_tok: int = 0
  norm_topk_prob: bool = False
  shared_expert_size: int = 0
  router_weights_float32: bool = False

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(
          f"Unknown architecture {self.arch!r}; expected one of "
          f"{ARCHITECTURES}.")
    for name in ("vocab_size", "hidden_size", "intermediate_size",
                 "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got "
                         f"{getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"Unknown activation {self.activation!r}; expected "
                       f"one of {ACTIVATIONS}.")
    if self.sliding_window_pattern is not None and (
        self.sliding_window is None or self.sliding_window_pattern < 1):
      raise ValueError(
          f"sliding_window_pattern={self.sliding_window_pattern} needs a "
          f"sliding_window and a pattern >= 1 (sliding_window="
          f"{self.sliding_window}).")
    for name in ("attn_logit_softcap", "final_logit_softcap",
                 "query_pre_attn_scalar", "sliding_window"):
      value = getattr(self, name)
      if value is not None and value <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive or None, "
                         f"got {value}.")

    if self.num_experts and not (
        1 <= self.num_experts_per_tok <= self.num_experts):
      raise ValueError(
          f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
          f"num_experts={self.num_experts}] for a mixture of experts.")
    if self.num_experts < 0 or (
        not self.num_experts and (self.num_experts_per_tok
                                  or self.shared_expert_size)):
      raise ValueError(
          f"num_experts_per_tok={self.num_experts_per_tok} and "
          f"shared_expert_size={self.shared_expert_size} need num_experts "
          f"> 0, got {self.num_experts}.")

  @property
  def is_moe(self) -> bool:
    """Whether the MLPs are mixtures of experts."""
    return self.num_experts > 0

  def is_local(self, layer: int) -> bool:
    """Whether layer `layer` attends through the sliding window."""
    if self.sliding_window is None:
      return False
    pattern = self.sliding_window_pattern
    return pattern is None or (layer + 1) % pattern != 0

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of layer `layer`, or None (full attention)."""
    return self.sliding_window if self.is_local(layer) else None

  def layer_rope(self, layer: int
                 ) -> tuple[float, RopeScaling | LinearRopeScaling | None]:
    """(rope base, rope scaling) of layer `layer`."""
    if self.rope_local_theta is not None and self.is_local(layer):
      return self.rope_local_theta, None
    return self.rope_theta, self.rope_scaling

  @property
  def num_params(self) -> int:
    return sum(_prod(s) for s in flatten(param_shapes(self)).values())

  def replace(self, **kwargs: Any) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready fields; `from_dict` inverts it."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> "ModelConfig":
    """Inverts `to_dict`, rebuilding `RopeScaling` or `LinearRopeScaling`
    (told apart by their fields)."""
    fields = dict(fields)
    scaling = fields.get("rope_scaling")
    if scaling is not None:
      kind = RopeScaling if "low_freq_factor" in scaling else LinearRopeScaling
      fields["rope_scaling"] = kind(**scaling)
    return cls(**fields)


def param_shapes(config: ModelConfig) -> dict[str, Any]:
  """The parameter pytree layout, as nested containers of shapes.

  Matrices are declared [in, out], the canonical layout; a `MatmulPlan`
  may store them [out, in] instead, chosen per machine by
  `specjax.tuning.matmul` (which layout keeps a (γ+1)-row verification pass
  near the cost of one row depends on the CPU). Layers are a list of
  per-layer dicts `layers_{i}` (Flax's names for a list of submodules): on
  CPU, XLA's dot on a slice of one stacked [L, ...] array copies the
  weights first, several times slower. A kernel plan still runs the layers
  as one loop (`MatmulPlan.layer_loop`): the kernel is handed every
  layer's matrix and reads the loop's one where it lies.

  Args:
    config: the model.

  Returns:
    `{'embed': (V, E), 'final_norm': (E,), 'layers_0': layer, ...,
    'layers_{L-1}': layer}` where each layer is `{'attn_norm': (E,),
    'q': (E, H*D), 'k': (E, K*D), 'v': (E, K*D), 'o': (H*D, E),
    'mlp_norm': (E,), 'gate': (E, F), 'up': (E, F), 'down': (F, E)}` plus
    `q_bias`, `k_bias`, `v_bias` when `config.qkv_bias`; `q_norm`,
    `k_norm` (D,) when `config.qk_norm` ((H*D,), (K*D,) unless
    `qk_norm_per_head`); in a mixture of experts, `'router': (E, X),
    'experts_gate': (X, F, E), 'experts_up': (X, F, E), 'experts_down':
    (X, F, E)` (stacked F-major, `specjax.models.moe`) in place of gate,
    up and down, and with a shared expert
    `'shared_gate': (E, F_s), 'shared_up': (E, F_s), 'shared_down':
    (F_s, E), 'shared_expert_gate': (E, 1)`; `attn_post_norm`, `mlp_post_norm`
    (E,) when `config.post_norms`; and
    `'lm_head': (E, V)` when embeddings are not tied (tied models project
    with `embed`).
  """
  c = config
  e, f = c.hidden_size, c.intermediate_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  layer = {
      "attn_norm": (e,),
      "q": (e, q),
      "k": (e, kv),
      "v": (e, kv),
      "o": (q, e),
      "mlp_norm": (e,),
  }
  if c.num_experts:
    x = c.num_experts
    layer.update(router=(e, x), experts_gate=(x, f, e),
                 experts_up=(x, f, e), experts_down=(x, f, e))
    if c.shared_expert_size:
      s = c.shared_expert_size
      layer.update(shared_gate=(e, s), shared_up=(e, s), shared_down=(s, e),
                   shared_expert_gate=(e, 1))
  else:
    layer.update(gate=(e, f), up=(e, f), down=(f, e))
  if c.qkv_bias:
    layer.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
  if c.qk_norm and c.qk_norm_per_head:
    layer.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
  elif c.qk_norm:
    layer.update(q_norm=(q,), k_norm=(kv,))
  if c.post_norms:
    layer.update(attn_post_norm=(e,), mlp_post_norm=(e,))
  shapes = {"embed": (c.vocab_size, e), "final_norm": (e,)}
  shapes.update({f"layers_{i}": dict(layer) for i in range(c.num_layers)})
  if not c.tie_embeddings:
    shapes["lm_head"] = (e, c.vocab_size)
  return shapes


def check_params(config: ModelConfig, params: Any) -> None:
  """Raises ValueError naming every missing, extra or misshapen tensor."""
  want = flatten(param_shapes(config))
  got = flatten(params)
  problems = []
  for name, shape in want.items():
    if name not in got:
      problems.append(f"missing tensor {name!r} (expected shape {shape})")
    elif tuple(got[name].shape) != tuple(shape):
      problems.append(f"tensor {name!r} has shape {tuple(got[name].shape)}, "
                      f"expected {shape}")
  problems += [f"unexpected tensor {name!r}" for name in got
               if name not in want]
  if problems:
    raise ValueError(f"Parameters do not match the {config.arch} config: "
                     + "; ".join(problems))


# Projections whose storage layout a `MatmulPlan` chooses; `embed` is always
# [V, E] (gathered by token, and the tied head's [out, in]).
_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
# A mixture of experts' instead of gate, up and down. The stacked experts
# [X, F, E] are no matrices of a plan: they stay in that layout whatever
# the plan, and are read by expert (`specjax.models.moe`, `expert_paths`).
_MOE_MATRICES = ("q", "k", "v", "o", "router")
_SHARED_MATRICES = ("shared_gate", "shared_up", "shared_down",
                    "shared_expert_gate")
EXPERT_PARAMS = ("experts_gate", "experts_up", "experts_down")


def experts_out_in(w: Any, name: str) -> Any:
  """Experts ([..., F, E] as stored; `name` or its path's last part one of
  `EXPERT_PARAMS`) as the [..., out, in] matrix each expert is, the
  layout a packed stack keeps, or back: down's last two axes swapped (it
  is stored [in, out]), gate and up as they are."""
  down = name.rpartition("/")[2] == "experts_down"
  return w.swapaxes(-1, -2) if down else w


def matrix_paths(config: ModelConfig) -> list[str]:
  """`flatten` paths of the projections a `MatmulPlan` may store [out, in]
  (`Model.with_plan` transposes them)."""
  names = _MATRICES
  if config.num_experts:
    names = _MOE_MATRICES + (_SHARED_MATRICES if config.shared_expert_size
                             else ())
  paths = [f"layers_{i}/{m}" for i in range(config.num_layers)
           for m in names]
  return paths + ([] if config.tie_embeddings else ["lm_head"])


def expert_paths(config: ModelConfig) -> list[str]:
  """`flatten` paths of a mixture of experts' stacked experts ([] for a
  dense model)."""
  if not config.num_experts:
    return []
  return [f"layers_{i}/{name}" for i in range(config.num_layers)
          for name in EXPERT_PARAMS]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{'a': {'b': x}, 'l': [y]} -> {'a/b': x, 'l/0': y}.

  Leaves are arrays or shapes (tuples of ints); the paths name parameters in
  checkpoints.
  """
  if isinstance(tree, dict):
    items = tree.items()
  elif isinstance(tree, (list, tuple)) and not _is_shape(tree):
    items = enumerate(tree)
  else:
    return {prefix[:-1]: tree}
  out = {}
  for k, v in items:
    out.update(flatten(v, f"{prefix}{k}/"))
  return out


def unflatten(config: ModelConfig, leaf: Any) -> dict[str, Any]:
  """The param pytree of `config` with `leaf(path, shape)` at each leaf.

  Args:
    config: fixes the tree (`param_shapes`).
    leaf: called with each parameter's `flatten` path and shape.

  Returns:
    A nested dict shaped like `param_shapes(config)`.
  """

  def build(tree, prefix):
    if isinstance(tree, dict):
      return {k: build(v, f"{prefix}{k}/") for k, v in tree.items()}
    return leaf(prefix[:-1], tree)

  return build(param_shapes(config), "")


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def _prod(shape) -> int:
  n = 1
  for s in shape:
    n *= s
  return n
