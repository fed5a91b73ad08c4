"""Megatron backend on 2 ranks (spawned processes) against the same run on 1 rank.

Layouts: tp=2 (one replica, vocab-parallel logits), dp=2 (two replicas, Megatron's DP rank slices
the rows), pp=2 (Megatron's 1F1B schedule, one layer per stage) and ep=2 (Qwen3-MoE, two experts
per rank, DP over the dense weights). Each run: log-probs and entropies (temperature 0.7), two
training steps of a policy-gradient + entropy loss, the gathered HF weights, a checkpoint, then a
third step. The 2-rank results must equal the 1-rank Megatron backend's: float32 throughout, the
only difference is the order of the sums that TP splits (row-parallel partial sums, vocab-sliced
log-sum-exp) or DP reduces (gradients), so log-probs within 1e-5 absolute, loss, grad norm and
the entropy metric (and one SFT step's loss and grad norm) within 1e-5 relative, weights after the steps within 2e-5 absolute (Adam eps
1e-3, so a step cannot amplify gradient rounding). Before training the gathered HF weights equal
the checkpoint's bit for bit; the 2-rank checkpoint (TP slices as DTensors, stages and experts under
their global names) reloads on 1 rank and takes the same third step.

CPU (gloo): tp runs as in production, dp inside the ep2 layout (dp=2 alone runs on GPUs only). Megatron-Core 0.16 allocates on CUDA inside its
pipeline schedule, P2P communicator and expert token gather (production refuses pp/ep > 1 on CPU,
``model.CUDA_ONLY``), so the CPU pp/ep runs redirect exactly those allocations to the CPU
(:class:`_CpuTorch`, test-only) to check this backend's pipeline and expert code paths on gloo.
On 2 GPUs (nccl) the same four layouts run unredirected.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.plugin_manifest import megatron_missing_api as missing_api
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.skipif(missing_api() is not None, reason=str(missing_api()))
P, T, V, ROWS, MINI = 4, 5, 80, 8, 4


def make_batch() -> DataProto:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (ROWS, P + T), generator=g)
    attn = torch.ones(ROWS, P + T, dtype=torch.long)
    attn[::3, :2] = 0  # left padding
    mask = (torch.rand(ROWS, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    tensors = {"input_ids": ids, "attention_mask": attn, "responses": ids[:, P:], "response_mask": mask,
               "advantages": torch.randn(ROWS, T, generator=g)}
    batch = DataProto.from_dict(tensors=tensors)
    batch.meta_info["temperature"] = 0.7
    return batch


def loss_fn(outputs, micro):
    mask, tokens = micro.batch["response_mask"], micro.meta_info["mini_batch_tokens"]
    pg = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / tokens
    return pg - 0.01 * (outputs["entropy"] * mask).sum() / tokens, {"actor/entropy": (outputs["entropy"] * mask).sum()}


def build(model_path: str, tp: int = 1, pp: int = 1, ep: int = 1, device: str = "cpu"):
    from lumenrl_backends.training.megatron import MegatronBackend

    return MegatronBackend(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        role="actor",
        optim=OptimConfig(lr=1e-2, eps=1e-3, lr_schedule="cosine", warmup_steps=1),
        train=PolicyTrainConfig(mini_batch_size=MINI, micro_batch_size=2),
        num_training_steps=3,
        device=torch.device(device),
        parallel=(tp, pp, ep),
    )


def run(backend, model_path: str, ckpt_dir: str) -> dict:
    batch = make_batch().to(backend.device)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    exact = all(torch.equal(t.cpu(), hf[n]) for n, t in backend.named_weights())
    log_probs, entropy = backend.compute_log_probs(batch[:5], temperature=0.7, with_entropy=True)  # 5 rows: padded
    steps = [backend.train_step(batch, loss_fn) for _ in range(2)]
    trained = {n: t.cpu().clone() for n, t in backend.named_weights()}  # named_weights may alias the parameters
    backend.save_checkpoint(ckpt_dir, extra={"step": 2})
    third = backend.train_step(batch, loss_fn)
    after = {n: t.cpu().clone() for n, t in backend.named_weights()}
    labels = batch.batch["input_ids"].masked_fill(batch.batch["attention_mask"] == 0, -100)
    labels[:, :P] = -100  # the response tokens are the targets
    sft_batch = DataProto.from_dict(tensors={k: batch.batch[k] for k in ("input_ids", "attention_mask")})
    sft_batch.batch["labels"] = labels
    sft = backend.sft_step(sft_batch, lr=1e-3)
    return {"exact": exact, "log_probs": log_probs.cpu().tolist(), "entropy": entropy.cpu().tolist(),
            "steps": [[m["actor/loss"], m["actor/grad_norm"], m["actor/entropy"]] for m in steps + [third]]
            + [[sft["sft/loss"], sft["sft/grad_norm"], sft["sft/tokens"]]], "trained": trained, "after": after}


class _Stream:
    """A CUDA stream/event stand-in: nothing to order on the CPU."""

    def wait_stream(self, other):
        return None

    def record_event(self):
        return self

    def synchronize(self):
        return None


class _CpuCuda:
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    current_device = staticmethod(lambda: "cpu")
    synchronize = staticmethod(lambda *a, **k: None)
    Stream = current_stream = staticmethod(lambda *a, **k: _Stream())
    stream = staticmethod(lambda s: contextlib.nullcontext())


class _CpuTorch(types.ModuleType):
    """``torch`` as the named Megatron modules see it in the CPU pp/ep tests: ``torch.cuda`` device and
    stream calls and ``device="cuda"`` allocations land on the CPU; everything else is torch."""

    _MODULES = ("pipeline_parallel.schedules", "pipeline_parallel.p2p_communication", "tensor_parallel.mappings",
                "transformer.moe.token_dispatcher", "transformer.moe.moe_utils", "utils")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *a, **k):
        return torch.zeros(*a, **self._cpu(k))

    def empty(self, *a, **k):
        return torch.empty(*a, **self._cpu(k))

    def tensor(self, *a, **k):
        return torch.tensor(*a, **self._cpu(k))

    @classmethod
    def install(cls) -> None:
        """Redirect the Megatron modules, and let the backend build pp/ep > 1 on the CPU."""
        import lumenrl_backends.training.megatron.backend as backend
        from lumenrl_backends.training.megatron.model import check_parallel

        for name in cls._MODULES:
            importlib.import_module(f"megatron.core.{name}").torch = cls()
        backend.check_parallel = lambda config, adapter, sizes, device: check_parallel(
            config, adapter, sizes, torch.device("cuda"))  # the model checks stay, the CPU refusal goes


def _worker(rank: int, world: int, port: int, out_dir: str, layouts: list, device: str) -> None:
    """Run each ``(name, model_path, sizes)`` layout in turn in one process group (a spawn, imports and gloo
    set-up cost seconds per rank); Megatron's model-parallel groups are rebuilt for every layout."""
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    for name, model_path, sizes in layouts:
        if device != "cuda" and (sizes[1] > 1 or sizes[2] > 1):
            _CpuTorch.install()  # tp-only layouts come first: they run unredirected, as in production
        out = os.path.join(out_dir, name)
        result = run(build(model_path, *sizes, device=device), model_path, os.path.join(out, "ckpt"))
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        torch.distributed.barrier()
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _spawn(spawn_ranks, out_dir, layouts: list, device: str = "cpu") -> dict[str, list[dict]]:
    """Two ranks run ``layouts`` (``(name, model_path, sizes)``); the name -> both ranks' results."""
    for name, _, _ in layouts:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    spawn_ranks(_worker, lambda port: (2, port, str(out_dir), layouts, device), 2,
                start_method="spawn" if device == "cuda" else "forkserver")
    return {name: [torch.load(os.path.join(out_dir, name, f"rank{r}.pt"), weights_only=False) for r in range(2)]
            for name, _, _ in layouts}


@pytest.fixture(scope="module")
def model_path(tiny_qwen3_path) -> str:
    return tiny_qwen3_path(vocab_size=V)  # Qwen3: 4 heads, 2 KV heads (q/k norms reduced over TP), 2 layers


@pytest.fixture(scope="module")
def moe_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("qwen3_moe", vocab_size=V))  # 4 experts, top-2, 2 layers


@pytest.fixture(scope="module")
def paths(tiny_qwen3_path, model_path, moe_path) -> dict[str, str]:
    return {"dense": model_path, "moe": moe_path, "tied": tiny_qwen3_path(vocab_size=V, tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    done: dict[str, dict] = {}

    def get(path: str) -> dict:
        if path not in done:
            done[path] = run(build(path), path, str(tmp_path_factory.mktemp("one") / "ckpt"))
        return done[path]

    return get


def _assert_matches(two: list[dict], one: dict) -> None:
    for result in two:
        assert result["exact"]  # gathered HF weights before training: bit-exact
        assert torch.allclose(torch.tensor(result["log_probs"]), torch.tensor(one["log_probs"]), atol=1e-5)
        assert torch.allclose(torch.tensor(result["entropy"]), torch.tensor(one["entropy"]), atol=1e-5)
        assert sum(result["steps"], []) == pytest.approx(sum(one["steps"], []), rel=1e-5, abs=1e-6)
        for name, tensor in one["after"].items():
            assert (result["after"][name] - tensor).abs().max() < 2e-5, name
    assert one["steps"][-1][0] != one["steps"][0][0]  # the trajectory moves


def _assert_reloads_on_one_rank(two: list[dict], model_path: str, ckpt: str) -> None:
    single = build(model_path)
    assert single.load_checkpoint(ckpt)["step"] == 2
    assert all(torch.equal(t, two[0]["trained"][n]) for n, t in single.named_weights())
    third = single.train_step(make_batch(), loss_fn)
    assert [third["actor/loss"], third["actor/grad_norm"]] == pytest.approx(two[0]["steps"][2][:2], rel=1e-5)
    for name, tensor in single.named_weights():
        assert (two[0]["after"][name] - tensor).abs().max() < 2e-5, name


# CPU: dp=2 alone is left to the GPU run; ep2 already runs Megatron's DP (rows sliced by DP rank, dense
# gradients reduced over DP) on CPU, and the test suite's time is bounded
LAYOUTS = {"tp2": ("dense", (2, 1, 1)), "tp2_tied": ("tied", (2, 1, 1)), "pp2": ("dense", (1, 2, 1)),
           "ep2": ("moe", (1, 1, 2))}
GPU_LAYOUTS = {**LAYOUTS, "dp2": ("dense", (1, 1, 1)),
               "pp2_tied": ("tied", (1, 2, 1))}  # Megatron moves the tied copy with .cuda() at build


@pytest.fixture(scope="module")
def two_gloo_ranks(paths, tmp_path_factory, spawn_ranks):
    """Every CPU layout on one pair of spawned gloo ranks (tp-only layouts first, see ``_worker``)."""
    out = tmp_path_factory.mktemp("two")
    order = sorted(LAYOUTS, key=lambda name: (max(LAYOUTS[name][1][1:]) > 1, name))  # pp/ep > 1: redirected
    return out, _spawn(spawn_ranks, out, [(name, paths[LAYOUTS[name][0]], LAYOUTS[name][1]) for name in order])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_gloo_ranks_match_one_rank(layout, paths, one_rank, two_gloo_ranks):
    path = paths[LAYOUTS[layout][0]]
    out, results = two_gloo_ranks
    _assert_matches(results[layout], one_rank(path))
    _assert_reloads_on_one_rank(results[layout], path, str(out / layout / "ckpt"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("layout", sorted(GPU_LAYOUTS))
def test_two_gpus_match_one_gpu(layout, paths, tmp_path, spawn_ranks):
    """nccl, no redirection; bf16 autocast (``mixed_precision`` auto on CUDA), so the bounds are the
    1-GPU bf16 test's (rounding differs between layouts, the math does not)."""
    kind, sizes = GPU_LAYOUTS[layout]
    path = paths[kind]
    two = _spawn(spawn_ranks, tmp_path, [(layout, path, sizes)], device="cuda")[layout]
    one = run(build(path, device="cuda"), path, str(tmp_path / "one"))
    for result in two:
        assert result["exact"]
        assert torch.allclose(torch.tensor(result["log_probs"]), torch.tensor(one["log_probs"]), atol=0.05)
        assert sum(result["steps"], []) == pytest.approx(sum(one["steps"], []), rel=0.05, abs=1e-3)
