"""``compile="full"``: the model's forward compiled as one graph, or compiled in pieces with a warning that says why.

``torch.compile`` without ``fullgraph`` never fails on a graph break: it splits the function, and where a break
cannot be split cleanly (an exception dynamo observes while tracing, say) it runs the whole frame eagerly and
compiles its callees one by one. The decode step still runs, but every residual add and norm becomes a kernel of
its own and small functions recompile per layer, with nothing said (decision 0023 has the case that slipped
through). :class:`WholeGraph` asks for the whole forward first (``fullgraph=True``); a graph break
raises while tracing, before anything executes, so the same call is then made through the piecewise compile, the
reason is kept in :attr:`WholeGraph.fallback` and a warning names it. Tests assert ``fallback is None`` for the
models the engine serves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WholeGraph"]


class WholeGraph:
    """``fn`` compiled with ``fullgraph=True`` (inductor ``options``); on a graph break, ``fn`` compiled in pieces."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None, *, what: str = "forward") -> None:
        self._fn, self._options, self._what = fn, options, what
        self._compiled = torch.compile(fn, fullgraph=True, options=options)
        self.fallback: str | None = None  # why the whole graph did not compile (None: it did, or not yet called)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:  # raised while tracing: nothing has run yet
            if self.fallback is not None:  # already the piecewise compile: a real error
                raise
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            self.fallback = f"{type(err).__name__}: {' '.join(lines[:2])[:300]}"
        warnings.warn(f"compile='full': the {self._what} does not compile as one graph ({self.fallback}); compiling it "
                      "in pieces (slower: more kernels per step)", stacklevel=2)
        self._compiled = torch.compile(self._fn, options=self._options)
        return self._compiled(*args, **kwargs)
