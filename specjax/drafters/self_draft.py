"""Self-speculation: drafting with the target's own first layers.

LayerSkip (Elhoushi et al. 2024) drafts with the first E layers of the
target followed by its final norm and LM head; Draft & Verify (Zhang et al.
2024) and SWIFT (Xia et al. 2024) skip a chosen set of layers instead. Both
need no extra weights. `EarlyExit` is a `DraftModel` over a
`specjax.models.LayerSubset` of the target: the same parameter arrays, a
cache of its own for the layers it runs (written only there), and the
draft model's whole machinery (catch-up after other drafters, rollback,
token trees). Its proposals carry the q they were sampled from, so the
rejection sampler keeps the target's distribution exactly.

Its own cache is the simple exact choice: the target's cache holds the
same keys and values for these layers at committed positions, but the
target overwrites the drafted slots in its verification pass, and a shared
cache would tie the drafter's state to the engine's. The cost is a prefill
of the drafted layers over the prompt (E/L of the target's) and their
cache.
"""

from __future__ import annotations

from typing import Sequence

from specjax.drafters.model import DraftModel
from specjax.models import LayerSubset
from specjax.models import Model


# pylint: disable-next=invalid-name
def EarlyExit(target: Model, exit_layer: int | None, *,
              skip: Sequence[int] = ()) -> DraftModel:
  """A drafter running layers [0, exit_layer) of `target` but `skip`.

  Args:
    target: the `Model` being verified.
    exit_layer: E in [1, L): draft with the first E layers (LayerSkip's
      early exit); None runs up to the last layer (layer skipping only).
    skip: static layer indices below E not to run (Draft & Verify, SWIFT).

  Raises:
    ValueError: E outside [1, L), skipped layers outside [0, E), or every
      layer skipped.
  """
  return DraftModel(LayerSubset.create(target, exit_layer=exit_layer,
                                       skip=skip))
