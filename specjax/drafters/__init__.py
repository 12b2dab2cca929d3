"""Drafters: what proposes tokens for the target to verify.

Every drafter subclasses `Drafter` (the declared protocol: `init`,
`propose`, `commit`, and capabilities with defaults).
"""

from specjax.drafters.base import Drafter
from specjax.drafters.cascade import Cascade
from specjax.drafters.fallback import Fallback
from specjax.drafters.jump import JumpForward
from specjax.drafters.lookup import LookupState
from specjax.drafters.lookup import ngram_matches
from specjax.drafters.lookup import PromptLookup
from specjax.drafters.lookup import trie
from specjax.drafters.model import DraftModel
from specjax.drafters.self_draft import EarlyExit
from specjax.drafters.track import Track
from specjax.step_types import Proposal

__all__ = ["Cascade", "DraftModel", "Drafter", "EarlyExit", "Fallback",
           "JumpForward", "LookupState", "PromptLookup", "Proposal", "Track",
           "ngram_matches", "trie"]
