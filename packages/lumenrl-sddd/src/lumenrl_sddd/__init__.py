"""Speculative-decoding draft distillation (SDDD) for LumenRL."""

from lumenrl_sddd.__about__ import __version__

__all__ = ["__version__"]
