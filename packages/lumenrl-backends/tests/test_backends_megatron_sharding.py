"""HF -> Megatron -> per-rank TP/PP/EP shards -> merged == HF, bit-exact (pure tensor logic: no
process groups, no megatron-core needed). The multi-rank runs of the same layout are in
test_backends_megatron_dist.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.models import tiny_config
from lumenrl_backends.training.megatron.families import ADAPTERS
from lumenrl_backends.training.megatron.sharding import (
    RankCoords,
    global_name,
    placement,
    rank_state_dict,
    tp_merge,
    tp_split,
)

LAYOUTS = {  # family -> (tp, pp, ep) sizes to cover
    "llama": [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1)],
    "qwen3": [(2, 1, 1), (2, 2, 1)],
    "qwen3_moe": [(1, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4)],
}


def _hf(family: str, tied: bool) -> tuple[object, dict[str, torch.Tensor]]:
    config = tiny_config(family, num_hidden_layers=4, vocab_size=96, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ranks(config, tp: int, pp: int, ep: int) -> list[RankCoords]:
    experts = getattr(config, "num_experts", 0) or 0
    return [RankCoords(num_layers=config.num_hidden_layers, num_experts=experts, tp=tp, pp=pp, ep=ep,
                       tp_rank=t, pp_rank=p, ep_rank=e)
            for t, p, e in itertools.product(range(tp), range(pp), range(ep))]


def _merge(full_names, shards: dict[RankCoords, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of rank_state_dict over all ranks: the owning stage / EP rank, TP slices merged."""
    some = next(iter(shards))
    out = {}
    for name in full_names:
        p = placement(name, some)
        owners = sorted((c for c in shards if c.pp_rank == p.stage and c.ep_rank == (p.expert_rank or 0)),
                        key=lambda c: c.tp_rank)
        out[name] = tp_merge([shards[c][p.local_name] for c in owners], p.split)
    return out


@pytest.mark.parametrize("family", sorted(LAYOUTS))
@pytest.mark.parametrize("tied", [False, True])
def test_shard_and_merge_round_trip_is_exact(family, tied):
    config, hf = _hf(family, tied)
    adapter = ADAPTERS[family]
    full = adapter.to_megatron(config, hf)
    for tp, pp, ep in LAYOUTS[family]:
        ranks = _ranks(config, tp, pp, ep)
        shards = {c: rank_state_dict(full, c, tied=tied) for c in ranks}
        for c, local in shards.items():  # every local name maps back to its full name
            for name in local:
                if name == "output_layer.weight" and tied:
                    continue  # the last stage's copy of the tied embedding (pp > 1)
                assert placement(global_name(name, c), c).local_name == name
        merged = _merge(full, shards)
        back = dict(adapter.to_hf(config, merged))
        assert back.keys() == hf.keys(), (tp, pp, ep)
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), (name, tp, pp, ep)
        if tied and pp > 1:  # the last stage holds the embedding's vocab slice as its output layer
            last = [c for c in ranks if c.pp_rank == pp - 1]
            copy = tp_merge([shards[c]["output_layer.weight"] for c in sorted(last, key=lambda c: c.tp_rank)
                             if c.ep_rank == 0], "rows")
            assert torch.equal(copy, hf["model.embed_tokens.weight"])


def test_tensor_parallel_slices_follow_megatron_layout():
    """Rank t: qkv rows of its query groups, [gate_t; up_t] for fc1, column slices of row-parallel weights."""
    config, hf = _hf("qwen3", tied=False)
    full = ADAPTERS["qwen3"].to_megatron(config, hf)
    c = RankCoords(num_layers=4, tp=2, tp_rank=1)
    local = rank_state_dict(full, c, tied=False)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]  # (F, H)
    F = gate.shape[0]
    assert torch.equal(local["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[F // 2 :], up[F // 2 :]]))
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(local["decoder.layers.0.self_attention.linear_proj.weight"], o[:, o.shape[1] // 2 :])
    k = hf["model.layers.0.self_attn.k_proj.weight"].view(2, -1, o.shape[0])[1]  # group 1's key head
    qkv = local["decoder.layers.0.self_attention.linear_qkv.weight"]  # (q+2)*hd rows of group 1
    hd = config.head_dim
    q_per = config.num_attention_heads // config.num_key_value_heads
    assert torch.equal(qkv[q_per * hd : (q_per + 1) * hd], k)
    emb = hf["model.embed_tokens.weight"]
    assert torch.equal(local["embedding.word_embeddings.weight"], emb[emb.shape[0] // 2 :])


def test_sizes_that_do_not_divide_are_refused():
    config, hf = _hf("llama", tied=False)
    full = ADAPTERS["llama"].to_megatron(config, hf)
    with pytest.raises(ValueError, match=r"policy.parallel.pp=3 does not divide num_hidden_layers=4"):
        RankCoords(num_layers=4, pp=3)
    with pytest.raises(ValueError, match=r"moe.expert_parallel_size=3 does not divide num_experts=4"):
        RankCoords(num_layers=4, num_experts=4, ep=3)
    with pytest.raises(ValueError, match=r"policy.parallel.tp=4 does not divide dim 0 \(2\) of .*linear_qkv"):
        full = {k: v for k, v in full.items() if "linear_qkv" in k}
        rank_state_dict({k: v[:2] for k, v in full.items()}, RankCoords(num_layers=4, tp=4), tied=False)
    assert [t.shape for t in tp_split(torch.zeros(8, 6), "swiglu", 2)] == [torch.Size([4, 6])] * 2
