"""Drafting heads on the target's own hidden states, and their training.

`specjax.heads.medusa`: Medusa heads (a Flax module and a `Drafter`);
`specjax.heads.eagle`: the EAGLE layer (a Flax module and a `Drafter`);
`specjax.heads.data`: teacher-forced features of a target over a corpus;
`specjax.heads.train`: self-distillation training with optax and orbax;
`specjax.heads.pipeline`: a whole training run from a config.
"""

from specjax.heads.eagle import Eagle
from specjax.heads.eagle import EagleLayer
from specjax.heads.eagle import EagleState
from specjax.heads.medusa import Medusa
from specjax.heads.medusa import MedusaHeads
from specjax.heads.medusa import MedusaState

__all__ = ["Eagle", "EagleLayer", "EagleState", "Medusa", "MedusaHeads",
           "MedusaState"]
