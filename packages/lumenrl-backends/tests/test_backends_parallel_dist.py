"""Tensor + sequence parallel, Ulysses context parallel (composed with FSDP2) and expert parallel
on gloo ranks == one rank, in float32.

One spawned process group per world size checks several families/meshes: loss, log-probs and
every parameter gradient (full tensors) against an unsharded copy of the same model.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lumenrl_backends.models.tiny import tiny_config
from lumenrl_backends.training.context_parallel import enable_ulysses, shard_sequence
from lumenrl_backends.training.expert_parallel import apply_expert_parallel
from lumenrl_backends.training.parallelize import MeshDims, build_mesh, check_tp, parallelize
from lumenrl_core.assembly.requirements import moe_layout_supported

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")


V = 64


def _model(family: str, **over):
    cfg = tiny_config(
        family, hidden_size=32, intermediate_size=64, head_dim=8, num_attention_heads=4,
        num_key_value_heads=over.pop("kv", 2), vocab_size=V, **over,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _loss_and_logprobs(model, ids):  # ids: (B, S)
    logits = model(input_ids=ids).logits  # (B, S, V), full vocab on every rank
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, S-1)
    return -logp.mean(), logp.detach()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _check(family: str, tp: int, world: int, rank: int, **over) -> None:
    ref = _model(family, **over)
    par = parallelize(copy.deepcopy(ref), build_mesh(MeshDims(world=world, tp=tp), "cpu"))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, 12), generator=gen)  # same batch on every rank
    loss_ref, lp_ref = _loss_and_logprobs(ref, ids)
    loss_ref.backward()
    dp, dp_rank = world // tp, rank // tp
    rows = ids.shape[0] // dp
    local = ids[dp_rank * rows : (dp_rank + 1) * rows]  # this dp rank's rows; tp ranks share them
    loss, lp = _loss_and_logprobs(par, local)
    loss.backward()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    assert torch.allclose(total / world, loss_ref, rtol=1e-5), (family, tp, float(total / world), float(loss_ref))
    assert torch.allclose(lp, lp_ref[dp_rank * rows : (dp_rank + 1) * rows], atol=1e-5), (family, tp)
    ref_grads, grads = _grads(ref), _grads(par)
    assert ref_grads.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), (family, tp, name)


def _check_cp(family: str, world: int, rank: int, **over) -> None:
    """Ulysses over all ranks (cp = world), FSDP2 over the same ranks (torchtitan's dp_shard_cp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ref = _model(family, **over)
    par = enable_ulysses(copy.deepcopy(ref), None, world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    for layer in par.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(par, mesh=mesh)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))
    loss_ref, lp_ref = _loss_and_logprobs(ref, ids)
    loss_ref.backward()
    local, positions = shard_sequence(ids, rank, world)
    chunk = local.shape[1]
    logits = par(input_ids=local, position_ids=positions).logits  # (B, S/cp, V)
    targets = ids[:, rank * chunk + 1 : (rank + 1) * chunk + 1]  # next tokens; the last chunk has one fewer
    logp = torch.log_softmax(logits[:, : targets.shape[1]], -1).gather(-1, targets[..., None]).squeeze(-1)
    count = ids.shape[0] * (ids.shape[1] - 1)
    (-logp.sum() / count * world).backward()  # FSDP2 averages over the world: the sum of the local terms
    total = -logp.detach().sum() / count
    torch.distributed.all_reduce(total)
    assert torch.allclose(total, loss_ref, rtol=1e-5), (family, "cp", float(total), float(loss_ref))
    assert torch.allclose(logp.detach(), lp_ref[:, rank * chunk : rank * chunk + targets.shape[1]], atol=1e-5)
    ref_grads = _grads(ref)
    for name, g in _grads(par).items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), (family, "cp", name)


def _check_ep(family: str, world: int, rank: int, **over) -> None:
    """ep = world: each rank owns E/ep experts and its own rows; tokens travel by all-to-all."""
    from torch.distributed.device_mesh import init_device_mesh

    ref = _model(family, **over)
    par = copy.deepcopy(ref)
    apply_expert_parallel(par, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    ids = torch.randint(0, V, (2 * world, 10), generator=torch.Generator().manual_seed(3))
    loss_ref, lp_ref = _loss_and_logprobs(ref, ids)
    loss_ref.backward()
    rows = ids.shape[0] // world
    loss, lp = _loss_and_logprobs(par, ids[rank * rows : (rank + 1) * rows])
    (loss / world).backward()  # equal rows per rank: the full-batch mean is the mean of the local means
    total = loss.detach() / world
    torch.distributed.all_reduce(total)
    assert torch.allclose(total, loss_ref, rtol=1e-5), (family, "ep", float(total), float(loss_ref))
    assert torch.allclose(lp, lp_ref[rank * rows : (rank + 1) * rows], atol=1e-5), (family, "ep")
    ref_grads, local = _grads(ref), dict(par.named_parameters())
    expert_names = [n for n in local if ".experts." in n]
    assert expert_names
    for name, p in local.items():
        g = p.grad
        if name in expert_names:  # this rank's slice of the experts (a DTensor Shard(0) over the ep ranks)
            g = g.to_local()
            n = g.shape[0]
            expected = ref_grads[name][rank * n : (rank + 1) * n]
        else:  # replicated: the data-parallel sum
            g = g.clone()
            torch.distributed.all_reduce(g)
            expected = ref_grads[name]
        assert torch.allclose(g, expected, rtol=1e-4, atol=1e-6), (family, "ep", name)


def _worker(rank: int, world: int, port: int, cases: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    try:
        for family, tp, over in cases:
            if tp == "ep":
                _check_ep(family, world, rank, **over)
            elif tp == "cp":
                _check_cp(family, world, rank, **over)
            else:
                _check(family, tp, world, rank, **over)
    finally:
        torch.distributed.destroy_process_group()


def _spawn(spawn_ranks, world: int, cases: list) -> None:
    spawn_ranks(_worker, lambda port: (world, port, cases), world)


def test_two_ranks_tp_sp_cp_ep_match_one_rank(spawn_ranks):
    # tp2 on MoE blocks (qwen3_moe, mixtral, glm4_moe, deepseek_v3): experts split over the intermediate dim (gate/up
    # rows matched), router replicated; glm4_moe/deepseek_v3 add shared experts (a dense MLP in the block) and a dense
    # first layer; deepseek_v3 MLA attention (replicated low-rank down projections, colwise up projections)
    _spawn(spawn_ranks, 2, [("qwen3", 2, {}), ("llama", 2, {}), ("qwen3", "cp", {}), ("llama", "cp", {}),
                                      ("qwen3_moe", "ep", {}), ("deepseek_v3", "ep", {"kv": 4}), ("glm4_moe", "ep", {}),
                                      ("qwen3_moe", 2, {}), ("mixtral", 2, {}), ("glm4_moe", 2, {"use_qk_norm": True}),
                                      ("deepseek_v3", 2, {"kv": 4})])


def test_four_ranks_fsdp_tp_and_ep_match_one_rank(spawn_ranks):
    # 2 (dp_shard) x 2 (tp) for qwen3; pure tp=4 for llama (4 KV heads); ep=4 for mixtral (1 expert per rank)
    _spawn(spawn_ranks, 4, [("qwen3", 2, {}), ("llama", 4, {"kv": 4}), ("mixtral", "ep", {})])


def test_tp_refusals_name_the_numbers():
    cfg = tiny_config("qwen3", num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2"):
        check_tp(cfg, 4, 4)
    with pytest.raises(ValueError, match=r"tp=3 must divide the world size 4"):
        check_tp(cfg, 3, 4)
    with pytest.raises(ValueError, match=r"model_type='qwen2_moe': the shared expert's sigmoid gate"):
        check_tp(AutoConfig.for_model("qwen2_moe"), 2, 2)
    with pytest.raises(ValueError, match=r"tp=2 does not divide moe_intermediate_size=33"):
        check_tp(tiny_config("qwen3_moe", moe_intermediate_size=33, vocab_size=V), 2, 2)
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 of mixtral"):
        check_tp(tiny_config("mixtral", router_jitter_noise=0.1, vocab_size=V), 2, 2)

