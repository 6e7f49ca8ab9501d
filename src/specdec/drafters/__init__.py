"""Drafters: each proposes tokens and the distributions they were drawn from."""

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.model import ModelDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter"]
