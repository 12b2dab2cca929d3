"""Drafters: what proposes tokens for the target to verify."""

from specjax.drafters.base import Drafter
from specjax.drafters.base import Proposal
from specjax.drafters.lookup import LookupState
from specjax.drafters.lookup import PromptLookup
from specjax.drafters.model import DraftModel
from specjax.drafters.model import DraftModelState

__all__ = ["DraftModel", "DraftModelState", "Drafter", "LookupState",
           "PromptLookup", "Proposal"]
