"""Drafting heads on the target's own hidden states, and their training.

`specjax.heads.medusa`: Medusa heads (a Flax module and a `Drafter`);
`specjax.heads.data`: teacher-forced features of a target over a corpus;
`specjax.heads.train`: self-distillation training with optax and orbax.
"""

from specjax.heads.medusa import Medusa
from specjax.heads.medusa import MedusaHeads
from specjax.heads.medusa import MedusaState

__all__ = ["Medusa", "MedusaHeads", "MedusaState"]
