"""Measured choices that depend on the machine (see `matmul`)."""

from specjax.tuning import matmul

__all__ = ["matmul"]
