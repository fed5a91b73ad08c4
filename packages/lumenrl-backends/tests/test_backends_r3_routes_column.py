"""``routes_column``: the batch's route rows laid out as ``routed_experts`` / ``router_probs``, checked against
a per-request reference on fresh random requests (ragged prompts and responses, rows recorded past the fed
tokens, requests without routes, probabilities on some requests only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lumenrl_backends.engines.routes import routes_column


def _reference(requests, prompt_width: int, width: int) -> dict[str, torch.Tensor]:
    """The layout, one request at a time."""
    owners = [r for r in requests if r.routes is not None]
    layers, k = owners[0].routes.shape[-2:]
    routes = torch.arange(k, dtype=owners[0].routes.dtype).expand(len(requests), prompt_width + width, layers, k).clone()
    with_probs = [r for r in owners if r.route_probs is not None]
    probs = torch.zeros(len(requests), prompt_width + width, layers, with_probs[0].route_probs.shape[-1]) \
        if with_probs else None
    for r in owners:
        lo = prompt_width - len(r.prompt)
        rows = r.routes[: len(r.prompt) + len(r.response) - 1]
        routes[r.index, lo: lo + rows.shape[0]] = rows
        if r.route_probs is not None:
            probs[r.index, lo: lo + rows.shape[0]] = r.route_probs[: rows.shape[0]]
    return {"routed_experts": routes, **({"router_probs": probs} if probs is not None else {})}


def _requests(seed: int, *, probs: bool):
    g = torch.Generator().manual_seed(seed)
    prompt_width, width, layers, k, experts = 12, 9, 3, 2, 6
    out = []
    for i in range(7):
        prompt = [1] * int(torch.randint(1, prompt_width + 1, (1,), generator=g))
        response = [2] * int(torch.randint(1, width + 1, (1,), generator=g))
        fed = len(prompt) + len(response) - 1
        recorded = fed + int(torch.randint(0, 2, (1,), generator=g))  # an interrupted row holds one row more
        has = i != 3  # one request recorded nothing
        routes = torch.randint(0, experts, (recorded, layers, k), generator=g, dtype=torch.int64).to(torch.int16) \
            if has else None
        route_probs = torch.rand(recorded, layers, experts, generator=g) if has and probs and i % 2 == 0 else None
        out.append(SimpleNamespace(index=i, prompt=prompt, response=response, routes=routes, route_probs=route_probs))
    return out, prompt_width, width


@pytest.mark.parametrize("probs", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_routes_column_matches_the_per_request_layout(seed, probs):
    requests, prompt_width, width = _requests(seed, probs=probs)
    got, want = routes_column(requests, prompt_width, width), _reference(requests, prompt_width, width)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert torch.equal(got["routed_experts"][3], torch.arange(2, dtype=torch.int16).expand(21, 3, 2))  # no routes: pad rows


def test_routes_column_without_routes_is_empty():
    requests = [SimpleNamespace(index=0, prompt=[1], response=[2], routes=None, route_probs=None)]
    assert routes_column(requests, 1, 1) == {}
