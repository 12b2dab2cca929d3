"""γ policies: how many tokens each speculative step drafts.

- `GammaPolicy`, the protocol (`init`, `budget`, `update`), and its
  optional extension `PlainRuns`;
- `Fixed`, `Heuristic` and the cost-model `Auto`, each with its own state;
- `StepCosts`, the forward costs every policy, the simulator and the
  benchmarks price a step with.
"""

from specjax.policies.auto import Auto
from specjax.policies.base import Fixed
from specjax.policies.base import GammaPolicy
from specjax.policies.base import Heuristic
from specjax.policies.base import HeuristicState
from specjax.policies.base import LONGEST_PLAIN_RUN
from specjax.policies.base import PlainRuns
from specjax.policies.base import PolicyState
from specjax.policies.costs import catch_up_ms
from specjax.policies.costs import drafting_ms
from specjax.policies.costs import ForwardCosts
from specjax.policies.costs import Roofline
from specjax.policies.costs import StepCosts
from specjax.policies.estimates import AutoState
from specjax.verify import verify_widths
from specjax.verify import width_index

__all__ = ["Auto", "AutoState", "Fixed", "ForwardCosts", "GammaPolicy",
           "Heuristic", "HeuristicState", "LONGEST_PLAIN_RUN", "PlainRuns",
           "PolicyState", "Roofline", "StepCosts", "catch_up_ms",
           "drafting_ms", "verify_widths", "width_index"]
