"""Training backends, rollout engines, controllers, trainers and the `lumenrl` CLI."""

from lumenrl_backends.__about__ import __version__

__all__ = ["__version__"]
