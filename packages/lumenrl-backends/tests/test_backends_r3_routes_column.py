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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["cuda", "mixed"])
def test_routes_column_from_device_rows_matches(where):
    """Rows on the engine's device (laid out there, one copy back) or on two devices (a continued batch: rows
    finished before the interrupt come back on the host) give the same host columns."""
    requests, prompt_width, width = _requests(4, probs=True)
    want = _reference(requests, prompt_width, width)
    for i, r in enumerate(requests):
        if where == "cuda" or i % 2:
            r.routes = r.routes.cuda() if r.routes is not None else None
            r.route_probs = r.route_probs.cuda() if r.route_probs is not None else None
    got = routes_column(requests, prompt_width, width)
    for name in want:
        assert got[name].device.type == "cpu" and torch.equal(got[name], want[name]), name


def test_routes_column_without_routes_is_empty():
    requests = [SimpleNamespace(index=0, prompt=[1], response=[2], routes=None, route_probs=None)]
    assert routes_column(requests, 1, 1) == {}


@pytest.mark.parametrize("probs", [False, True])
@pytest.mark.parametrize("finishing", [1, 5])
def test_finished_rows_are_copied_out_in_one_gather(probs, finishing):
    """``EngineRoutes.take`` queues, ``flush`` copies: each request gets exactly its slot's rows [start, end)
    (ragged starts and ends, an end past the buffer, an empty range), as the per-request slices were."""
    from transformers import AutoModelForCausalLM

    from lumenrl_backends.engines.routes import EngineRoutes
    from lumenrl_backends.models.tiny import tiny_config
    from lumenrl_core.assembly.requirements import moe_layout_supported

    if not moe_layout_supported():
        pytest.skip("needs the transformers >= 5.13 MoE layout")
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", num_hidden_layers=2, num_experts=8))
    rec = EngineRoutes(model, max_slots=6, max_len=10, device=torch.device("cpu"), record_probs=probs)
    g = torch.Generator().manual_seed(finishing)
    rec.routes.copy_(torch.randint(0, 8, rec.routes.shape, generator=g).to(rec.routes.dtype))
    if probs:
        rec.probs.copy_(torch.rand(rec.probs.shape, generator=g))
    spans = [(0, 2, 9), (3, 0, 10), (1, 4, 14), (5, 6, 6), (2, 1, 5)][:finishing]  # (slot, start, end)
    requests = [SimpleNamespace(routes=None, route_probs=None) for _ in spans]
    for request, (slot, start, end) in zip(requests, spans):
        rec.start[slot] = start
        rec.take(request, slot, end)
    assert all(r.routes is None for r in requests)  # queued, not copied yet
    want = [(rec.routes[slot, start:end].clone(), rec.probs[slot, start:end].clone() if probs else None)
            for slot, start, end in spans]
    rec.flush()
    rec.routes.zero_()  # the slots are reused: the requests hold copies
    if probs:
        rec.probs.zero_()
    for request, (routes, route_probs) in zip(requests, want):
        assert torch.equal(request.routes, routes)
        assert (request.route_probs is None) if not probs else torch.equal(request.route_probs, route_probs)
    rec.flush()  # nothing queued: a no-op
    assert torch.equal(requests[0].routes, want[0][0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_ranges_is_the_concatenation_of_aranges(seed):
    """Random block starts and lengths (empty blocks included) against the per-block loop it replaces."""
    from lumenrl_backends.engines.routes import row_ranges

    g = torch.Generator().manual_seed(seed)
    blocks = int(torch.randint(1, 40, (1,), generator=g))
    starts = torch.randint(0, 10_000, (blocks,), generator=g).tolist()
    counts = torch.randint(0, 300, (blocks,), generator=g).tolist()
    counts[0] = 0
    want = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, counts)])
    got = row_ranges(starts, counts)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert row_ranges([5, 9], [0, 0]).numel() == 0
