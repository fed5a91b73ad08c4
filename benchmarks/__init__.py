"""LumenRL's benchmark suite (``python -m benchmarks``; entries in :mod:`benchmarks.suite`)."""

import warnings

# A figure measured while compile="full" ran the model's forward in pieces is not the engine's figure: the engine's
# warning (lumenrl_backends.engines.whole_graph) stops a benchmark instead of leaving a slower number in the history.
warnings.filterwarnings("error", message=r"compile='full': the .* does not compile as one graph")
