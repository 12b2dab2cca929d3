"""The draft cost ratio c: timed single forwards of each model.

Shape letters (`specjax.shapes`): B batch, P padded prompt, S cache size, T
tokens per forward.

c = (median time of one single-token decode step of the draft) / (the same
for the target), on the same B prompts, prefilled so attention reads a warm
cache of realistic length, each step timed as one more iteration of a
compiled loop of them, as the decoding loop runs it (`hardware.looped_ms`).
The cache is donated and rolled back inside the loop, so repeats neither
copy nor grow it. The target's verification pass (T = γ+1 tokens) is timed
the same way: Leviathan et al.'s predicted speedup assumes it costs one
target forward.

The memory-bandwidth roofline of a decode step is the target's weight bytes
per token divided by the bandwidth of a large-array read (a jitted sum over
`READ_BYTES`), timed after the forwards.
"""

from __future__ import annotations

from typing import Any, Sequence

from specjax import hardware
from specjax.tuning.cost import compiled_forward_hlo
from specjax.tuning.cost import forward_step
from specjax.tuning.cost import READ_BYTES
from specjax.tuning.cost import read_step

__all__ = ["compiled_forward_hlo", "forward_step", "measure_cost",
           "read_step"]

def measure_cost(target: Any, draft: Any | None,
                 prompts: Sequence[Sequence[int]], cache_size: int,
                 gammas: Sequence[int], repeats: int) -> dict[str, Any]:
  """Forward times of both models on the same B rows, and c.

  Returns:
    For each of `draft` and `target`: `{m}_forward_ms`, per γ
    `{m}_verify_ms` (γ+1 tokens) and `{m}_verify_ratio` (verify / forward);
    `draft_cost_ratio` (c) and `verify_cost_ratio` (the target's); for
    models that report `weight_bytes_per_token`, the read bandwidth and
    each model's roofline (`{m}_weight_gb`, `{m}_roofline_ms`, and
    `{m}_forward_efficiency` = roofline / measured forward). With `draft`
    None (no draft model loaded) the target is timed alone, and no
    `draft_` key is returned.
  """
  models = {"target": target} if draft is None else {"draft": draft,
                                                      "target": target}
  steps = {}
  for name, model in models.items():
    steps[(name, 1)] = forward_step(model, prompts, cache_size, 1)
    for g in gammas:
      steps[(name, g + 1)] = forward_step(model, prompts, cache_size, g + 1)
  weight_bytes = {name: getattr(model, "weight_bytes_per_token", None)
                  for name, model in models.items()}
  ms = hardware.looped_ms(steps, repeats)
  if weight_bytes["target"]:
    ms.update(hardware.median_ms({"read": read_step()}, repeats))
  out = {"batch_size": len(prompts), "repeats": repeats}
  for name in models:
    forward = ms[(name, 1)]
    verify = {str(g): ms[(name, g + 1)] for g in gammas}
    out[f"{name}_forward_ms"] = forward
    out[f"{name}_verify_ms"] = verify
    out[f"{name}_verify_ratio"] = {g: v / forward for g, v in verify.items()}
  if draft is not None:
    out["draft_cost_ratio"] = (out["draft_forward_ms"]
                               / out["target_forward_ms"])
  out["verify_cost_ratio"] = out["target_verify_ratio"]  # the one c needs
  if "read" in ms:
    bandwidth = READ_BYTES / (ms["read"] / 1e3)  # bytes/s
    out["read_bandwidth_gb_s"] = bandwidth / 1e9
    for name in models:
      if weight_bytes[name]:
        roofline_ms = 1e3 * weight_bytes[name] / bandwidth
        out[f"{name}_weight_gb"] = weight_bytes[name] / 1e9
        out[f"{name}_roofline_ms"] = roofline_ms
        out[f"{name}_forward_efficiency"] = (roofline_ms
                                            / out[f"{name}_forward_ms"])
  return out
