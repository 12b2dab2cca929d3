"""Drafters: what proposes tokens for the target to verify."""

from specjax.drafters.base import Drafter
from specjax.drafters.base import Proposal
from specjax.drafters.model import DraftModel
from specjax.drafters.model import DraftModelState

__all__ = ["DraftModel", "DraftModelState", "Drafter", "Proposal"]
