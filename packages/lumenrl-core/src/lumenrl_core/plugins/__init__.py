"""LumenRL's plugin registry: one entry-point group per plugin kind (``lumenrl.<kind>``).

    from lumenrl_core.plugins import get_registry

    registry = get_registry()
    registry.names("rollout_engines")          # ['hf', 'native', ...] -- nothing imported
    registry.info("rollout_engines", "vllm")   # PluginInfo(available=False, reason="module 'vllm' ...")
    cls = registry.load("rollout_engines", "native")  # imports the class

Plugins are selected by name from the run config and never auto-activated. See
:mod:`lumenrl_core.plugins.registry` for the rules, :mod:`lumenrl_core.plugins.spec` for the
torch-free :class:`PluginSpec` an entry point names, and :mod:`lumenrl_core.plugins.probes` for
availability probes.
"""

from lumenrl_core.plugins.compat import (
    IncompatibleSiblingsError,
    core_requirement_problem,
    core_version,
    require_compatible_siblings,
    sibling_requirement_problems,
)
from lumenrl_core.plugins.kinds import GROUP_PREFIX, KINDS, KNOWN_PROVIDERS, group_of, install_hint
from lumenrl_core.plugins.probes import cuda_probe, first_reason, module_installed, module_probe
from lumenrl_core.plugins.registry import (
    DuplicatePluginError,
    PluginError,
    PluginInfo,
    PluginLoadError,
    PluginRegistry,
    UnknownPluginError,
    get_registry,
    set_registry,
)
from lumenrl_core.plugins.spec import PluginSpec

__all__ = [
    "KINDS",
    "GROUP_PREFIX",
    "KNOWN_PROVIDERS",
    "group_of",
    "install_hint",
    "core_version",
    "core_requirement_problem",
    "sibling_requirement_problems",
    "require_compatible_siblings",
    "IncompatibleSiblingsError",
    "module_probe",
    "module_installed",
    "cuda_probe",
    "first_reason",
    "PluginError",
    "UnknownPluginError",
    "DuplicatePluginError",
    "PluginLoadError",
    "PluginInfo",
    "PluginSpec",
    "PluginRegistry",
    "get_registry",
    "set_registry",
]
