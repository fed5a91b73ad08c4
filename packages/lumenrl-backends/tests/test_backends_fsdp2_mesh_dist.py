"""FSDP2Backend on a parallelism mesh (gloo ranks, float32) == the 1-rank backend.

Cases: tp=2 (qwen3), cp=2 (qwen3 actor and critic, 9 columns: padded to the cp multiple, left/right
padding), ep=2 and tp=2 (experts split over the intermediate dim) each with R3
replay of random routes (qwen3_moe) on 2 ranks; dp2 x tp2 (qwen3), tp2 x cp2 (llama, activation
checkpointing: the recompute repeats the collectives), dp2 x cp2 with ep=2
laid over the four dp x cp ranks (qwen3_moe: expert slices FSDP-sharded over 2 ranks) and dp2 x tp2 with
ep=2 over the dp ranks (mixtral: EP x TP on the experts) on 4 ranks. Each
case checks ``compute_log_probs`` (log-probs and entropy on the valid response tokens), one ``train_step``
and one ``sft_step`` (loss, grad norm) and every updated parameter (full tensors from ``named_weights``, the rank-0 HF export
and the sharded checkpoint reloaded on one rank) against one rank.
Bounds: log-probs/entropy 2e-5 absolute, loss and grad norm 1e-4 relative, parameters 2e-5 absolute after
one AdamW step with lr 1e-2 and eps 1e-3 (a large eps keeps the first step a smooth function of the
gradient: with eps 1e-8 it is lr * sign(g), which rounding flips where g is ~1e-8).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from lumenrl_backends.models.tiny import tiny_config
from lumenrl_backends.training.expert_parallel import apply_expert_parallel
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_backends.training.lora import apply_lora
from lumenrl_backends.training.parallelize import MeshDims, check_sizes
from lumenrl_backends.training.weights_io import full_tensor
from lumenrl_core.assembly.requirements import moe_layout_supported
from lumenrl_core.config.schema import LoraConfig, OptimConfig, PolicyTrainConfig, R3Config
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")

P, T, V, ROWS = 4, 5, 64, 4
R3 = R3Config(enabled=True)


def make_batch(moe_layers: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (ROWS, P + T), generator=g)
    attn = torch.ones(ROWS, P + T, dtype=torch.long)
    attn[::2, :2] = 0  # left-padded prompts
    attn[1, -2:] = 0  # a right-padded response
    mask = attn[:, P:].float()
    tensors = {"input_ids": ids, "attention_mask": attn, "responses": ids[:, P:], "response_mask": mask,
               "advantages": torch.randn(ROWS, T, generator=g)}
    if moe_layers:  # random top-2 of 4 experts per token and layer: replay must pick exactly these
        tensors["routed_experts"] = torch.rand(ROWS, P + T, moe_layers, 4, generator=g).argsort(-1)[..., :2]
    return DataProto.from_dict(tensors=tensors)


def loss_fn(outputs, micro):  # policy gradient, or a value regression for the critic
    adv = micro.batch["advantages"]
    per_token = (outputs["values"] - adv) ** 2 if "values" in outputs else -adv * outputs["log_probs"]
    return (per_token * micro.batch["response_mask"]).sum() / micro.meta_info["mini_batch_tokens"], {}


def build(path: str, lora: bool | list[str] = False, **kwargs) -> FSDP2Backend:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:  # adapters on the dense linears (a list: these targets); B made non-zero so A gets gradients too
        targets = {"target_modules": lora} if isinstance(lora, list) else {}
        model = apply_lora(model, LoraConfig(rank=4, alpha=8.0, **targets))
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return build_model(model, **kwargs)


def build_model(model, recompute: bool = False, **kwargs) -> FSDP2Backend:
    train = PolicyTrainConfig(mini_batch_size=ROWS, micro_batch_size=2, gradient_checkpointing=recompute)
    torch.manual_seed(0)  # the critic's value head: the same init on every rank and in the reference
    return FSDP2Backend(model, role="actor", optim=OptimConfig(lr=1e-2, eps=1e-3), train=train, num_training_steps=1,
                        device=torch.device("cpu"), **kwargs)


def run_case(path: str, tp: int = 1, cp: int = 1, ep: int = 1, r3: bool = False, recompute: bool = False,
             critic: bool = False, lora: bool = False, out: str | None = None) -> dict:
    """Log-probs and entropy (a critic: values), one update's metrics and the updated weights (full tensors,
    every rank); with ``out``, the HF export (``out/hf``) and the checkpoint (``out/ckpt``) of the update."""
    backend = build(path, lora, r3=R3 if r3 else None, tp=tp, cp=cp, ep=ep, recompute=recompute, value_head=critic)
    batch = make_batch(backend.hf_config.num_hidden_layers if r3 else 0)
    if critic:
        log_probs, entropy = backend.compute_values(batch), None
    else:
        log_probs, entropy = backend.compute_log_probs(batch, with_entropy=True)
    metrics = {k.partition("/")[2]: v for k, v in backend.train_step(batch, loss_fn).items()}
    weights = {k: v.clone() for k, v in backend.named_weights()}
    optim = optim_state(backend)
    if out is not None:
        backend.save_hf(os.path.join(out, "hf"))
        backend.save_checkpoint(os.path.join(out, "ckpt"))
    sft = {"sft/loss": 0.0, "sft/grad_norm": 0.0}
    if not (r3 or critic):  # the SFT forward too (sft_step does not reset R3 replay: its batches carry no routes)
        labels = batch.batch["input_ids"].masked_fill(batch.batch["attention_mask"] == 0, -100)
        labels[:, :P] = -100  # the response is the target (a pad position predicting a first token is noise)
        sft = backend.sft_step(DataProto.from_dict(tensors={**batch.batch, "labels": labels}))
    return {"log_probs": log_probs, "entropy": entropy, "loss": metrics["loss"], "optim": optim,
            "grad_norm": metrics["grad_norm"], "weights": weights, "sft": [sft["sft/loss"], sft["sft/grad_norm"]]}


def optim_state(backend: FSDP2Backend) -> dict[str, torch.Tensor]:
    """Parameter name -> full Adam ``exp_avg_sq`` (collective under FSDP2: every rank, the same order)."""
    names = {id(p): n for n, p in backend.weights_module.named_parameters()}
    return {names[id(p)]: full_tensor(st["exp_avg_sq"]).clone() for p, st in backend.optimizer.state.items()}


def _worker(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    for name, path, kwargs in cases:
        result = run_case(path, **kwargs, out=os.path.join(out_dir, name))
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _check(spawn_ranks, tmp_path, world: int, cases: list) -> None:
    spawn_ranks(_worker, lambda port: (world, port, cases, str(tmp_path)), world)
    valid = make_batch().batch["response_mask"].bool()
    for name, path, kwargs in cases:
        lora = kwargs.get("lora", False)
        one = run_case(path, r3=kwargs.get("r3", False), critic=kwargs.get("critic", False), lora=lora,
                       out=str(tmp_path / f"{name}.one") if lora else None)
        for rank in range(world):  # every rank returns the whole results
            got = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            for key in ("log_probs", "entropy")[: 1 if kwargs.get("critic") else 2]:
                err = (got[key] - one[key])[valid].abs().max().item()
                assert err < 2e-5, (name, rank, key, err)
            assert got["loss"] == pytest.approx(one["loss"], rel=1e-4), (name, rank)
            assert got["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), (name, rank)
            assert got["sft"] == pytest.approx(one["sft"], rel=1e-4), (name, rank)
            assert got["weights"].keys() == one["weights"].keys()
            for k, v in one["weights"].items():
                err = (got["weights"][k] - v).abs().max().item()
                assert err < 2e-5, (name, rank, k, err)
        restored = build(path, lora, value_head=kwargs.get("critic", False))
        if lora:
            _check_lora(tmp_path, name, path, one, restored, lora)
            continue
        exported = _state(str(tmp_path / name / "hf"))  # the rank-0 HF export of the sharded weights
        restored.load_checkpoint(str(tmp_path / name / "ckpt"))  # the sharded checkpoint, on one rank
        shared = exported.keys() & one["weights"].keys()  # a critic exports its backbone (+ value_head file)
        assert len(shared) > 10, name
        for k in shared:
            assert (exported[k] - one["weights"][k]).abs().max().item() < 2e-5, (name, "export", k)
        for k, v in restored.named_weights():
            assert (v - one["weights"][k]).abs().max().item() < 2e-5, (name, "checkpoint", k)
        _check_optim(name, restored, one)
        initial = _state(path)
        moved = max((one["weights"][k] - initial[k]).abs().max().item() for k in shared)
        assert moved > 1e-3, name  # the update is real


def _check_optim(name: str, restored: FSDP2Backend, one: dict) -> None:
    """The sharded checkpoint's Adam state (fused gate_up_proj through its (E, 2, I, H) view) reloaded on one rank."""
    got = optim_state(restored)
    assert got.keys() == one["optim"].keys() and got, name
    for k, v in one["optim"].items():
        # (1 - beta2) g^2: the gradients agree to ~1e-4 relative; a misplaced gate/up half would be O(1) off
        assert (got[k] - v).abs().max().item() <= 1e-3 * v.abs().max().item(), (name, "adam state", k)


def _check_lora(tmp_path, name: str, path: str, one: dict, restored: FSDP2Backend, lora: bool | list[str]) -> None:
    """LoRA on the mesh: the merged export equals one rank's; the checkpoint's peft adapter loads with peft and
    holds the trained adapters; the sharded checkpoint reloads on one rank; only adapters moved."""
    from peft import PeftModel

    exported, expected = _state(str(tmp_path / name / "hf")), _state(str(tmp_path / f"{name}.one" / "hf"))
    assert exported.keys() == expected.keys()
    for k, v in expected.items():
        assert (exported[k] - v).abs().max().item() < 2e-5, (name, "merged export", k)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                        str(tmp_path / name / "ckpt" / "adapter"))
    adapters = {k: v for k, v in adapted.state_dict().items() if "lora_" in k}
    assert len(adapters) > 10, name
    for k, v in adapters.items():
        assert (v - one["weights"][k]).abs().max().item() < 2e-5, (name, "peft adapter", k)
    restored.load_checkpoint(str(tmp_path / name / "ckpt"))
    _check_optim(name, restored, one)
    initial = build(path, lora)
    start = dict(initial.named_weights())
    for k, v in restored.named_weights():
        assert (v - one["weights"][k]).abs().max().item() < 2e-5, (name, "checkpoint", k)
        moved = (one["weights"][k] - start[k]).abs().max().item()
        assert (moved > 1e-3) == (".lora_" in k), (name, "moved", k, moved)  # adapters train, the base is frozen


def _state(path: str) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def paths(tiny_model_dir) -> dict[str, str]:
    common = {"vocab_size": V, "initializer_range": 0.2}
    return {"qwen3": str(tiny_model_dir("qwen3", **common)),
            "llama": str(tiny_model_dir("llama", num_key_value_heads=4, **common)),
            "qwen3_moe": str(tiny_model_dir("qwen3_moe", **common)),
            "mixtral": str(tiny_model_dir("mixtral", intermediate_size=32, **common)),
            "glm4_moe": str(tiny_model_dir("glm4_moe", attention_bias=True, **common))}


PEFT = importlib.util.find_spec("peft") is not None  # LoRA is an extra (lumenrl-backends[lora]); the min env lacks it


def _with_peft(cases: list[tuple]) -> list[tuple]:
    """The cases this environment can run: LoRA cases need peft (the others run everywhere)."""
    return [case for case in cases if PEFT or not case[2].get("lora")]


def test_two_ranks_tp_cp_ep_match_one_rank(paths, tmp_path, spawn_ranks):
    _check(spawn_ranks, tmp_path, 2, _with_peft([
        ("tp2", paths["qwen3"], {"tp": 2}),
        ("cp2", paths["qwen3"], {"cp": 2}),
        ("cp2_critic", paths["qwen3"], {"cp": 2, "critic": True}),
        ("ep2_r3", paths["qwen3_moe"], {"ep": 2, "r3": True}),
        ("tp2_moe_r3", paths["qwen3_moe"], {"tp": 2, "r3": True}),  # experts split over tp; replayed routes
        ("cp2_lora", paths["qwen3"], {"cp": 2, "lora": True}),
        ("tp2_lora", paths["qwen3"], {"tp": 2, "lora": True}),  # A/B colwise/rowwise around the sharded bases
        # attention adapters (with biases) on an MoE model: frozen split experts, shared experts, dense first layer
        ("tp2_lora_moe", paths["glm4_moe"], {"tp": 2, "lora": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
    ]))


def test_four_ranks_dp_tp_cp_ep_match_one_rank(paths, tmp_path, spawn_ranks):
    _check(spawn_ranks, tmp_path, 4, _with_peft([
        ("dp2_tp2", paths["qwen3"], {"tp": 2}),
        ("tp2_cp2", paths["llama"], {"tp": 2, "cp": 2, "recompute": True}),  # with activation checkpointing
        ("dp2_cp2_ep2", paths["qwen3_moe"], {"cp": 2, "ep": 2}),
        ("dp2_tp2_ep2", paths["mixtral"], {"tp": 2, "ep": 2}),  # EP x TP on the experts, TP on attention
        ("cp2_ep4_lora", paths["qwen3_moe"], {"cp": 2, "ep": 4, "lora": True}),  # frozen experts, 1 per rank
    ]))


def test_mesh_refusals_name_the_numbers():
    qwen3, moe = tiny_config("qwen3", vocab_size=V), tiny_config("qwen3_moe", vocab_size=V)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"policy.parallel.tp=2 \* cp=2 = 4 does not divide num_key_value_heads=2"):
        check_sizes(qwen3, MeshDims(world=4, tp=2, cp=2))
    with pytest.raises(ValueError, match=r"policy.parallel.tp=4 \* cp=1 = 4 must divide the world size 6"):
        check_sizes(qwen3, MeshDims(world=6, tp=4))
    with pytest.raises(ValueError, match=r"moe.expert_parallel_size=4 must divide the 2 data x context parallel ranks"):
        check_sizes(moe, MeshDims(world=2, ep=4))
    with pytest.raises(ValueError, match=r"moe.expert_parallel_size=4 must divide the 2 data x context parallel"):
        check_sizes(moe, MeshDims(world=4, tp=2, ep=4))  # EP is laid over dp x cp, not over the TP ranks
    model = AutoModelForCausalLM.from_config(qwen3)
    with pytest.raises(ValueError, match=r"R3 replay lays out whole rows, not sequence chunks"):
        build_model(model, r3=R3, cp=2)
    with pytest.raises(ValueError, match=r"no tensor-parallel plan for the critic's value head"):
        build_model(model, value_head=True, tp=2)
    with pytest.raises(ValueError, match=r"tp=2 \* cp=1 = 2 must divide the world size 1"):
        build_model(model, tp=2)  # this process is one rank
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 of mixtral"):
        check_sizes(tiny_config("mixtral", vocab_size=V, router_jitter_noise=0.1), MeshDims(world=2, tp=2))


@pytest.mark.skipif(not PEFT, reason="LoRA needs peft (pip install 'lumenrl-backends[lora]')")
def test_lora_mesh_refusals():
    qwen3 = tiny_config("qwen3", vocab_size=V)
    lora = apply_lora(AutoModelForCausalLM.from_config(qwen3), LoraConfig(rank=4, dropout=0.1))
    with pytest.raises(ValueError, match=r"policy.lora.dropout=0.1 draws a different mask on each TP rank"):
        build_model(lora, tp=2)
    # the default targets (gate/up/down_proj) make peft adapt glm4_moe's fused expert tensors: EP/TP refuse
    glm = apply_lora(AutoModelForCausalLM.from_config(tiny_config("glm4_moe", vocab_size=V)), LoraConfig(rank=4))
    with pytest.raises(ValueError, match=r"peft put LoRA adapters on the fused experts"):
        apply_expert_parallel(glm, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))


def test_moe_checkpoint_of_the_older_fused_layout_still_loads(paths, tmp_path, monkeypatch):
    """Checkpoints store fused gate_up_proj as (E, 2, I, H); one written as (E, 2I, H) (before) loads too."""
    from lumenrl_backends.training import checkpoint

    backend = build(paths["qwen3_moe"])
    backend.train_step(make_batch(), loss_fn)
    trained = {k: v.clone() for k, v in backend.named_weights()}
    for name, old in (("new", False), ("old", True)):
        with monkeypatch.context() as m:
            if old:
                m.setattr(checkpoint, "_stored_layout", lambda state: state)
            backend.save_checkpoint(str(tmp_path / name))
        meta = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / name / "model_optim")).read_metadata()
        fused = [v.size for k, v in meta.state_dict_metadata.items() if k.endswith("experts.gate_up_proj")]
        assert fused and all(len(size) == (3 if old else 4) for size in fused), (name, fused)
        restored = build(paths["qwen3_moe"])
        restored.load_checkpoint(str(tmp_path / name))
        for k, v in restored.named_weights():
            assert torch.equal(v, trained[k]), (name, k)
        got, expected = optim_state(restored), optim_state(backend)
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            assert torch.equal(got[k], v), (name, "adam", k)
