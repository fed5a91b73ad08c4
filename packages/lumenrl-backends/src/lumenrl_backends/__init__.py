"""Training backends, rollout engines, controllers, trainers and the `lumenrl` CLI.

At import, the installed sibling packages (lumenrl-core, -quant, -moe, -sddd, -async) are checked
against the ranges this distribution declares (its ``Requires-Dist``); an incompatible one is
refused with :class:`lumenrl_core.plugins.IncompatibleSiblingsError`, one line per sibling.
"""

from lumenrl_backends.__about__ import __version__
from lumenrl_core.plugins.compat import require_compatible_siblings

require_compatible_siblings("lumenrl-backends")

__all__ = ["__version__"]
