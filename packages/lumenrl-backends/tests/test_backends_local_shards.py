"""The clip norm and fused AdamW step of FSDP2's DTensor parameters on their local shards (training.local_shards)
against DTensor's own path: equal bit for bit on one rank, the norm within float32 rounding on two."""

from __future__ import annotations

import os

import pytest
import torch

from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training import local_shards

CPU = torch.device("cpu")


def _sharded_model(seed: int, mesh, device: torch.device = CPU) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    with device:
        model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 24),
                                    torch.nn.LayerNorm(24), torch.nn.Linear(24, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _backward(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 12, generator=g).to(next(model.parameters()).device)
    (model(x).square().sum() * scale).backward()


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist_utils.ensure_process_group(CPU)
    return init_device_mesh("cpu", (1,))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_on_local_shards_equals_dtensor_step_bit_for_bit(device, monkeypatch):
    """Five clipped AdamW steps (weight decay, a scheduler, one step skipped for a non-finite loss) through
    ``fused_clip_and_step``: the local-shard step and DTensor's ``optimizer.step()`` give the same norms, skips,
    parameters, moments and step counts, bit for bit; the local path ran for every step after the first."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dist_utils.ensure_process_group(torch.device(device))
    mesh = init_device_mesh(device, (1,))
    runs = {}
    for local in (True, False):
        model = _sharded_model(0, mesh, torch.device(device))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        used: list[bool] = []

        def spy(o, used=used, real=local_shards.step_on_local_shards):
            used.append(real(o))
            return used[-1]

        monkeypatch.setattr(dist_utils, "step_on_local_shards", spy if local else (lambda o: False))
        norms = []
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            _backward(model, seed=step, scale=3.0)
            params = [p for p in model.parameters() if p.grad is not None]
            loss = float("nan") if step == 3 else 1.0
            norm, skipped = dist_utils.fused_clip_and_step(opt, params, max_norm=0.5, loss=loss)
            norms.append((norm.clone(), skipped.clone()))
            sched.step()
        state = [(p.full_tensor(), s["exp_avg"].full_tensor(), s["exp_avg_sq"].full_tensor(), s["step"])
                 for p, s in ((p, opt.state[p]) for p in model.parameters())]
        runs[local] = (norms, state, used)
    (norms_l, state_l, used), (norms_d, state_d, _) = runs[True], runs[False]
    assert used == [False, True, True, True, True]  # the first step creates the state through step()
    assert [float(s) for _, s in norms_l] == [0, 0, 0, 1, 0]
    for (a, sa), (b, sb) in zip(norms_l, norms_d, strict=True):
        assert torch.equal(a, b) and torch.equal(sa, sb)
    for left, right in zip(state_l, state_d, strict=True):
        for a, b in zip(left, right, strict=True):
            assert torch.equal(a, b)
    assert float(state_l[0][3]) == 4.0  # five steps, one skipped


def test_local_step_refuses_what_it_does_not_cover(one_rank_mesh):
    """No state yet, not fused, amsgrad, a step hook, not Adam: False, and no parameter or state changed."""
    model = _sharded_model(1, one_rank_mesh)
    _backward(model, seed=1)

    def refused(opt) -> None:
        before = [p.full_tensor().clone() for p in model.parameters()]
        states = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        assert not local_shards.step_on_local_shards(opt)
        assert all(torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before, strict=True))
        for s, t in zip(opt.state.values(), states, strict=True):
            assert all(torch.equal(s[k], t[k]) for k in t)

    refused(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))  # no state: step() creates it
    for opt in (torch.optim.AdamW(model.parameters(), lr=1e-2),
                torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, amsgrad=True)):
        opt.step()
        refused(opt)
    hooked = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    hooked.step()
    hooked.register_step_post_hook(lambda *a: None)
    refused(hooked)
    refused(torch.optim.SGD(model.parameters(), lr=1e-2))


def test_sharded_grad_norm_only_for_all_shard_layouts(one_rank_mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = _sharded_model(2, one_rank_mesh)
    _backward(model, seed=2)
    grads = [p.grad for p in model.parameters()]
    norm = local_shards.sharded_grad_norm(grads)
    ref = torch.linalg.vector_norm(torch.cat([g.full_tensor().double().flatten() for g in grads]))
    assert norm is not None and not hasattr(norm, "device_mesh")
    assert abs(float(norm) - float(ref)) <= 1e-6 * float(ref)
    replicated = distribute_tensor(torch.ones(3), one_rank_mesh, [Replicate()])
    assert local_shards.sharded_grad_norm([replicated]) is None
    assert local_shards.sharded_grad_norm([torch.ones(3)]) is None
    assert local_shards.sharded_grad_norm([]) is None


def _two_rank_norm(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _sharded_model(3, mesh)
        _backward(model, seed=10 + rank)  # different data per rank: FSDP averages the gradients
        grads = [p.grad for p in model.parameters()]
        fast = local_shards.sharded_grad_norm(grads)
        slow = torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor()
        ref = torch.linalg.vector_norm(torch.cat([g.full_tensor().double().flatten() for g in grads]))
        assert abs(float(fast) - float(ref)) <= 1e-6 * float(ref), (float(fast), float(ref))
        assert abs(float(fast) - float(slow)) <= 1e-6 * float(ref)
    finally:
        dist.destroy_process_group()


def test_sharded_grad_norm_sums_over_ranks(spawn_ranks):
    """Two gloo ranks, gradients sharded over both: the norm of the local shards summed over the mesh equals
    the float64 norm of the whole gradients and DTensor's own reduction."""
    spawn_ranks(_two_rank_norm, lambda port: (2, port), nprocs=2)
