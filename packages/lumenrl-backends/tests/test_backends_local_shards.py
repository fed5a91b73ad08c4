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
            norm, skipped = dist_utils.fused_clip_and_step(opt, params, max_norm=0.5, loss=loss, flat=False)
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


# The flat AdamW kernels over FSDP2's local shards (Triton's interpreter on the CPU), against torch's fused AdamW
# on the same shards and a float64 norm, on one rank and on two (uneven shards: one rank holds none of a (1, 5)
# weight). Each rank is a forked child of the interpreted script (the script's process keeps no process group).
_FLAT_SHARDS = r"""
import json, math, multiprocessing, os, socket, tempfile
import torch
import torch.distributed as dist


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_on(mesh):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 400), torch.nn.GELU(), torch.nn.Linear(400, 24),
                                torch.nn.LayerNorm(24), torch.nn.Linear(24, 5), torch.nn.Linear(5, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    (model(torch.randn(7, 12, generator=g)).square().sum() * 3.0).backward()


def worker(rank, world, addr, out):
    from torch.distributed.device_mesh import init_device_mesh
    from lumenrl_backends.training import distributed as dist_utils, local_shards
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(addr))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    runs = {}
    for name, flat, reload in (("flat", True, False), ("fused", False, False), ("reloaded", True, True)):
        model = model_on(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        rows = {"norm": [], "skipped": [], "flat": []}
        ref = [p.full_tensor().double() for p in model.parameters()]  # float64 AdamW on the whole tensors
        m64, v64, t64 = [torch.zeros_like(r) for r in ref], [torch.zeros_like(r) for r in ref], 0
        for step in range(5):
            if reload and step == 3:  # state replaced by load_state_dict: the flat stepper copies it back in
                saved = opt.state_dict()
                saved["state"] = {k: {n: t.clone() for n, t in s.items()} for k, s in saved["state"].items()}
                opt.load_state_dict(saved)
            opt.zero_grad(set_to_none=True)
            backward(model, seed=10 * step + rank)  # different data per rank
            params = [p for p in model.parameters() if p.grad is not None]
            norm64 = math.sqrt(sum(float(p.grad.full_tensor().double().square().sum()) for p in params))
            loss = float("nan") if step == 2 else 1.0
            if step != 2:
                lr, t64 = opt.param_groups[0]["lr"], t64 + 1
                b1, b2 = (float(torch.tensor(b, dtype=torch.float32)) for b in (0.9, 0.999))  # as fp32 AdamW holds them
                coef = min(0.5 / (norm64 + 1e-6), 1.0)
                for r, m, v, p in zip(ref, m64, v64, model.parameters()):
                    g = p.grad.full_tensor().double() * coef
                    r.mul_(1 - lr * 0.1)
                    m.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    r.sub_(lr / (1 - b1 ** t64) * m / ((v / (1 - b2 ** t64)).sqrt() + 1e-8))
            norm, skipped = dist_utils.fused_clip_and_step(opt, params, 0.5, loss, flat=flat)
            entry = local_shards._FLAT.get(opt)
            rows["flat"].append(local_shards.flat_steps(opt) == step + 1)
            rows["norm"].append(abs(float(norm) - norm64) / norm64)
            rows["skipped"].append(float(skipped))
            sched.step()
        rows["params"] = [p.full_tensor() for p in model.parameters()]
        rows["ref"], rows["ref_moments"] = ref, [t for pair in zip(m64, v64) for t in pair]
        rows["moments"] = [opt.state[p][k].full_tensor() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
        rows["steps"] = sorted({float(opt.state[p]["step"]) for p in model.parameters()})
        runs[name] = rows
        if flat and reload:  # the weak-keyed cache keeps neither the optimizer nor its stepper alive
            import gc, weakref
            gone = weakref.ref(opt)
            model = opt = sched = entry = None
            gc.collect()
            rows["released"] = gone() is None and not local_shards._FLAT  # the "flat" run's optimizer went too
            continue
        if flat:
            stepper = local_shards._FLAT[opt][1]
            lo, hi = stepper.exp_avg.data_ptr(), stepper.exp_avg.data_ptr() + 4 * stepper.exp_avg.numel()
            state = opt.state[next(iter(model.parameters()))]["exp_avg"]
            rows["dtensor_views"] = hasattr(state, "device_mesh") and lo <= state._local_tensor.data_ptr() < hi
            fewest = torch.tensor([min(p._local_tensor.numel() for p in model.parameters())])
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # some rank holds no element of some parameter
            rows["empty_shard"] = int(fewest) == 0
            rows["unaligned"] = any(p.grad._local_tensor.data_ptr() % 16 for p in model.parameters()
                                    if p.grad._local_tensor.numel())
    if rank == 0:
        def rel(a, b):
            return max(float((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30))
                       for x, y in zip(a, b))
        f, t, r = runs["flat"], runs["fused"], runs["reloaded"]
        row = {"case": f"world{world}", "flat": f["flat"], "fused_flat": t["flat"], "norm": max(f["norm"]),
               "skipped": f["skipped"], "skipped_fused": t["skipped"], "steps": f["steps"] + t["steps"],
               "params": rel(f["params"], f["ref"]), "params_fused": rel(t["params"], t["ref"]),
               "moments": rel(f["moments"], f["ref_moments"]),
               "reloaded_equal": all(torch.equal(a, b) for a, b in zip(r["params"] + r["moments"],
                                                                       f["params"] + f["moments"])),
               "released": r["released"], "dtensor_views": f["dtensor_views"], "empty_shard": f["empty_shard"], "unaligned": f["unaligned"]}
        with open(out, "w") as fh:
            json.dump(row, fh)
    dist.destroy_process_group()


ctx = multiprocessing.get_context("fork")
with tempfile.TemporaryDirectory() as tmp:
    for world in (1, 2):
        out, addr = os.path.join(tmp, f"{world}.json"), port()
        procs = [ctx.Process(target=worker, args=(r, world, addr, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        print(open(out).read())
"""


def test_flat_adamw_over_local_shards_matches_fused_adamw(triton_interpreted):
    """Five clipped steps (weight decay, a scheduler, one skipped for a non-finite loss) through
    ``fused_clip_and_step(flat=True)``: the flat kernels over the fp32 local shards give torch's fused AdamW's
    parameters within float32 rounding of a float64 AdamW (as close as torch's fused AdamW is), the float64 norm of the whole gradients (summed
    over the ranks on two), the same skips; the optimizer state stays DTensors over the stepper's flat buffers, and
    an optimizer whose state was replaced by ``load_state_dict`` continues bit for bit."""
    rows = triton_interpreted({"flat": _FLAT_SHARDS}).json_rows("flat")
    assert set(rows) == {"world1", "world2"}, rows
    for name, row in rows.items():
        assert row["flat"] == [True] * 5 and row["fused_flat"] == [False] * 5, (name, row)
        assert row["skipped"] == row["skipped_fused"] == [0.0, 0.0, 1.0, 0.0, 0.0], (name, row)
        assert row["steps"] == [4.0, 4.0], (name, row)
        # float32 arithmetic against float64 over four steps (torch's fused AdamW on the CPU: ~3e-5 on this model)
        assert row["norm"] < 1e-6 and row["params"] < 1e-5 and row["moments"] < 1e-5, (name, row)
        assert row["params"] <= row["params_fused"] + 1e-6, (name, row)
        assert row["reloaded_equal"] and row["released"] and row["dtensor_views"] and row["unaligned"], (name, row)  # (1,) bias: offset 5
    assert rows["world2"]["empty_shard"] and not rows["world1"]["empty_shard"], rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flat_adamw_over_local_shards_on_cuda():
    """On a one-rank CUDA mesh (the default there: ``flat=None``), a 151936 x 256 embedding and layers, three
    clipped steps: the flat kernels ran; against a float64 AdamW on the same gradients (with the betas rounded to
    float32, as both AdamWs hold them) their parameters are within float32 rounding and no further off than torch's
    fused AdamW's (whose bias corrections are float32), and the norms are the float64 norms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = torch.device("cuda")
    dist_utils.ensure_process_group(cuda)
    mesh = init_device_mesh("cuda", (1,))
    errors = {}
    for flat in (None, False):
        torch.manual_seed(0)
        with cuda:
            model = torch.nn.Sequential(torch.nn.Embedding(151936, 256), torch.nn.Linear(256, 1000),
                                        torch.nn.Linear(1000, 256))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        ref = [p.full_tensor().detach().double() for p in model.parameters()]
        m64, v64 = [torch.zeros_like(r) for r in ref], [torch.zeros_like(r) for r in ref]
        ids = torch.randint(0, 151936, (16, 64), device=cuda, generator=torch.Generator(cuda).manual_seed(1))
        for t in range(1, 4):
            opt.zero_grad(set_to_none=True)
            model(ids).float().square().mean().backward()
            params = [p for p in model.parameters() if p.grad is not None]
            grads = [p.grad.full_tensor().double() for p in params]
            norm64 = float(torch.stack([g.norm() for g in grads]).norm())
            norm, skipped = dist_utils.fused_clip_and_step(opt, params, 0.5, flat=flat)
            assert float(skipped) == 0.0 and abs(float(norm) - norm64) <= 1e-5 * norm64
            b1, b2 = (float(torch.tensor(b, dtype=torch.float32)) for b in (0.9, 0.999))  # as fp32 AdamW holds them
            for r, m, v, g in zip(ref, m64, v64, grads):
                g = g * min(0.5 / (norm64 + 1e-6), 1.0)
                r.mul_(1 - 1e-3 * 0.1)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                r.sub_(1e-3 / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + 1e-8))
        assert local_shards.flat_steps(opt) == (3 if flat is None else 0)
        errors[flat] = max(float((p.full_tensor().detach().double() - r).abs().max() / r.abs().max())
                           for p, r in zip(model.parameters(), ref))
    assert errors[None] < 2e-6 and errors[None] <= errors[False] + 1e-7, errors
