"""Drafters: what proposes tokens for the target to verify."""

from specjax.drafters.base import Drafter
from specjax.drafters.base import Proposal
from specjax.drafters.base import components
from specjax.drafters.base import extra_positions
from specjax.drafters.cascade import Cascade
from specjax.drafters.fallback import Fallback
from specjax.drafters.lookup import LookupState
from specjax.drafters.lookup import ngram_matches
from specjax.drafters.lookup import PromptLookup
from specjax.drafters.lookup import trie
from specjax.drafters.model import DraftModel
from specjax.drafters.self_draft import EarlyExit
from specjax.drafters.track import Track

__all__ = ["Cascade", "DraftModel", "Drafter", "EarlyExit", "Fallback",
           "LookupState",
           "PromptLookup", "Proposal", "Track", "components",
           "extra_positions", "ngram_matches", "trie"]
