"""R3 routes follow the padding-free layouts: packed / trimmed / padded token order, and back."""

from __future__ import annotations

import torch

from lumenrl_backends.training.packing import (
    PackPlan,
    TrimPlan,
    layout_routes,
    pack_input_ids,
    plan_micro_batch,
    unlayout_tokens,
)
from lumenrl_moe import validate_routes


def _grid(b=4, L=10, resp=4, layers=2, k=2, experts=6):
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(b, L, dtype=torch.long)
    for i, (left, right) in enumerate([(3, 0), (1, 2), (4, 3), (0, 1)][:b]):
        mask[i, :left] = 0
        if right:
            mask[i, L - right:] = 0
    ids = torch.randint(3, 100, (b, L), generator=g)
    routes = torch.rand(b, L, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.int16)  # distinct
    return mask, ids, routes, resp


def test_packed_routes_follow_the_packed_tokens():
    mask, ids, routes, resp = _grid()
    plan = plan_micro_batch(mask, resp, mode="auto", align=1)
    assert isinstance(plan, PackPlan)
    packed_ids = pack_input_ids(plan, ids).reshape(-1)
    token_id_grid = ids.reshape(-1)
    laid = layout_routes(plan, routes)  # (R*C, L_moe, k)
    real = plan.src >= 0
    assert torch.equal(packed_ids[real], token_id_grid[plan.src[real]])  # same tokens ...
    assert torch.equal(laid[real], routes.reshape(-1, *routes.shape[2:])[plan.src[real]])  # ... same routes
    validate_routes(laid[~real])  # filler rows repeat no expert
    flags = torch.zeros(laid.shape[0], dtype=torch.uint8)
    flags[real] = (plan.src[real] % 3 == 0).to(torch.uint8)
    back = unlayout_tokens(plan, flags, tuple(mask.shape)).reshape(-1)
    assert torch.equal(back[plan.src[real]], flags[real])


def test_trimmed_and_padded_routes():
    mask, _, routes, resp = _grid()
    mask[:, :1] = 0
    mask[:, -1:] = 0
    plan = plan_micro_batch(mask, resp, mode="trim")
    assert isinstance(plan, TrimPlan)
    laid = layout_routes(plan, routes)
    assert torch.equal(laid, routes[:, plan.lo : plan.hi].reshape(-1, *routes.shape[2:]))
    assert torch.equal(layout_routes(None, routes), routes.reshape(-1, *routes.shape[2:]))
    values = torch.arange(laid.shape[0], dtype=torch.float32)
    back = unlayout_tokens(plan, values, tuple(mask.shape))
    assert torch.equal(back[:, plan.lo : plan.hi].reshape(-1), values)


def test_dynamic_sampling_rounds_pad_routes_without_repeating_experts():
    from lumenrl_backends.trainers.rollout import concat_rounds
    from lumenrl_core.data_proto import DataProto

    def round_(rows, P, T):
        ids = torch.randint(3, 50, (rows, P + T))
        routes = torch.rand(rows, P + T, 2, 5).argsort(-1)[..., :3].to(torch.int16)
        return DataProto.from_dict(tensors={"prompts": ids[:, :P], "responses": ids[:, P:], "input_ids": ids,
                                            "attention_mask": torch.ones_like(ids), "routed_experts": routes})

    a, b = round_(2, 3, 4), round_(3, 5, 2)
    merged = concat_rounds([a, b])
    routes = merged.batch["routed_experts"]
    assert routes.shape == (5, 9, 2, 3)
    validate_routes(routes, num_experts=5)
    assert torch.equal(routes[:2, 2:9], a.batch["routed_experts"])  # left-padded by 2, no right pad
    assert torch.equal(routes[2:, :5 + 2], b.batch["routed_experts"])  # right-padded by 2
