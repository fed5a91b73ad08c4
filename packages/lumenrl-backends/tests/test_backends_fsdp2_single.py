"""Single-device fast path of the FSDP2 backend against the fully_shard one-rank path (CPU, tiny Qwen3)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.sync import sync_to_engine, trainer_weights
from lumenrl_backends.training import fsdp2 as fsdp2_mod
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_backends.training.single_device import SingleDeviceWeights
from lumenrl_core.config.loader import ConfigError, load_config
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig, TrainingQuantConfig
from lumenrl_core.data_proto import DataProto

CPU = torch.device("cpu")
P, T, V = 5, 6, 96


def make_batch(rows: int = 4, seed: int = 1) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, P + T), generator=g)
    attn = torch.ones(rows, P + T, dtype=torch.long)
    attn[0, :2] = 0
    resp_mask = torch.ones(rows, T)
    resp_mask[1, 3:] = 0
    attn[1, P + 3 :] = 0
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": attn, "responses": ids[:, P:], "response_mask": resp_mask,
        "advantages": torch.randn(rows, T, generator=g),
    })


def nll_loss(outputs, micro):
    mask = micro.batch["response_mask"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["mini_batch_tokens"]
    return loss, {"actor/entropy": (outputs["entropy"].detach() * mask).sum() / mask.sum()}


@pytest.fixture
def backend(tiny_qwen3_lm):
    """``backend(single, role=, micro=, wd=, **kw)``: an FSDP2 backend on a fresh tiny Qwen3 (tied embeddings)."""

    def make(single: str, *, role: str = "actor", micro: int = 2, wd: float = 0.1, **kw) -> FSDP2Backend:
        optim = None if role == "ref" else OptimConfig(lr=1e-2, grad_clip=0.5, weight_decay=wd, lr_schedule="linear")
        train = PolicyTrainConfig(micro_batch_size=micro, single_device=single)
        model = tiny_qwen3_lm(vocab_size=V, tie_word_embeddings=True)
        return FSDP2Backend(model, role=role, optim=optim, train=train, num_training_steps=10, device=CPU, **kw)

    return make


def master_state(b: FSDP2Backend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in b.named_weights()}


def assert_close_states(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).norm() <= rel * b[name].norm() + 1e-7, name


def test_modes_and_layout(backend):
    fast, sharded = backend("auto"), backend("off")
    assert fast.single is not None and sharded.single is None
    assert not any(hasattr(p, "full_tensor") for p in fast.model.parameters())
    assert fast.optimizer.param_groups[0]["params"] == fast.single.masters  # the optimizer steps fp32 masters
    for p, m in zip(fast.model.parameters(), fast.single.masters, strict=True):
        assert m.dtype == torch.float32 and m.shape == p.shape and torch.equal(p, m)
        assert (p.data_ptr() - fast.single.compute_flat.data_ptr()) % (64 * p.element_size()) == 0
        assert (m.data_ptr() - fast.single.master_flat.data_ptr()) % (64 * 4) == 0  # 64-element aligned
    assert backend("auto", role="ref").single.grad_flat is None  # no gradient buffers for a frozen ref
    names = [n for n, _ in fast.named_weights()]
    assert names == [n for n, _ in sharded.named_weights()] and "lm_head.weight" in names  # tied name kept
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in sharded.model.modules() if isinstance(m, FSDPModule)]
    assert units == [sharded.model]  # one rank: the root is the only fully_shard unit (no per-layer hooks)


def test_bad_modes_are_named(backend):
    with pytest.raises(ValueError, match="single_device='sometimes'.*auto, on, off"):
        backend("sometimes")
    with pytest.raises(ConfigError, match="single_device"):
        load_config(None, ["policy.train.single_device=yes"])
    assert load_config(None, ["policy.train.single_device=off"]).policy.train.single_device == "off"
    assert load_config(None).policy.train.single_device == "auto"
    pytest.importorskip("lumenrl_quant.training")
    fp8 = TrainingQuantConfig(precision="fp8", recipe="tensorwise")
    assert backend("auto", fp8=fp8).single is None  # FP8 linears keep the fully_shard path
    with pytest.raises(ValueError, match="single_device='on'.*FP8"):
        backend("on", fp8=fp8)


def test_bad_weights_and_clip_are_named():
    ints = torch.nn.Linear(2, 2)
    ints.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    with pytest.raises(ValueError, match="floating point.*torch.int64"):
        SingleDeviceWeights(ints, torch.float32)
    weights = SingleDeviceWeights(torch.nn.Linear(2, 2), torch.float32)
    opt = torch.optim.AdamW(weights.trainable)
    with pytest.raises(ValueError, match="max_norm=0.*> 0"):
        weights.fused_clip_and_step(opt, 0.0)


@pytest.mark.parametrize("micro", [4, 1])
def test_steps_match_the_fully_shard_path(micro, backend):
    """Same loss, grad norm and fp32 master update as fully_shard on one rank, over 3 steps."""
    batch = make_batch(4)
    fast, sharded = backend("on", micro=micro), backend("off", micro=micro)
    for _ in range(3):
        mf, ms = fast.train_step(batch, nll_loss), sharded.train_step(batch, nll_loss)
        assert set(mf) == set(ms)
        for key in ms:
            assert mf[key] == pytest.approx(ms[key], rel=1e-5, abs=1e-7), key
    assert_close_states(master_state(fast), master_state(sharded), 1e-5)
    for p, m in zip(fast.model.parameters(), fast.single.masters):
        assert torch.equal(p, m)  # fp32 compute on CPU: copy_back is exact
    lp_f = fast.compute_log_probs(batch)[0]
    lp_s = sharded.compute_log_probs(batch)[0]
    assert torch.allclose(lp_f, lp_s, atol=1e-5)


def test_bf16_compute_matches_fully_shard_mixed_precision(monkeypatch, backend):
    """bf16 compute weights + fp32 masters vs FSDP2's MixedPrecisionPolicy(bf16, fp32), forced on CPU."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    monkeypatch.setattr(fsdp2_mod, "compute_dtype", lambda mode, device: torch.bfloat16)
    monkeypatch.setattr(
        fsdp2_mod, "mixed_precision", lambda mode, device: MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    )
    batch = make_batch(4)
    fast, sharded = backend("on", micro=2), backend("off", micro=2)
    assert next(fast.model.parameters()).dtype == torch.bfloat16
    for _ in range(2):
        mf, ms = fast.train_step(batch, nll_loss), sharded.train_step(batch, nll_loss)
        assert mf["actor/loss"] == pytest.approx(ms["actor/loss"], rel=1e-3, abs=1e-5)
        assert mf["actor/grad_norm"] == pytest.approx(ms["actor/grad_norm"], rel=1e-3)
    assert_close_states(master_state(fast), master_state(sharded), 2e-3)
    for p, m in zip(fast.model.parameters(), fast.single.masters):
        assert torch.equal(p, m.to(torch.bfloat16))  # compute weights = masters rounded


def test_accumulate_grads_in_fp32_against_float64():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    model[1].weight.requires_grad_(False)
    w = SingleDeviceWeights(model, torch.bfloat16)
    assert [m.requires_grad for m in w.masters] == [True, True, False] and len(w.trainable) == 2
    expected = [torch.zeros_like(m, dtype=torch.float64) for m in w.masters[:2]]
    for _ in range(3):
        model(torch.randn(4, 7, dtype=torch.bfloat16)).square().sum().backward()
        for e, p in zip(expected, model.parameters()):
            e += p.grad.double()
        w.accumulate_grads()
        assert all(p.grad is None for p in model.parameters())
    for e, m in zip(expected, w.masters[:2]):
        assert m.grad.dtype == torch.float32 and torch.allclose(m.grad.double(), e, rtol=1e-6, atol=1e-6)
    assert w.masters[2].grad is None  # no gradient: the optimizer skips it (as with FSDP2)
    with torch.no_grad():
        w.masters[0].add_(0.123)
    w.copy_back()
    assert torch.equal(model[0].weight, w.masters[0].to(torch.bfloat16))
    w.zero_grad()
    assert all(m.grad is None for m in w.masters)


def test_checkpoint_resume_and_cross_path_load(tmp_path, backend):
    """Resume gives the same next steps; a fast-path checkpoint loads into fully_shard and back."""
    batch, batch2 = make_batch(4), make_batch(4, seed=7)
    first = backend("on")
    first.train_step(batch, nll_loss)
    first.save_checkpoint(str(tmp_path / "ck"), extra={"step": 1})
    after = [first.train_step(batch2, nll_loss)["actor/loss"] for _ in range(2)]
    want = master_state(first)
    for mode in ("on", "off"):
        resumed = backend(mode)
        assert resumed.load_checkpoint(str(tmp_path / "ck")) == {"step": 1}
        got = [resumed.train_step(batch2, nll_loss)["actor/loss"] for _ in range(2)]
        assert got == pytest.approx(after, rel=1e-6)
        assert_close_states(master_state(resumed), want, 1e-6)
        if resumed.single is not None:
            assert all(torch.equal(p, m) for p, m in zip(resumed.model.parameters(), resumed.single.masters))
    sharded = backend("off")
    sharded.train_step(batch, nll_loss)
    sharded.save_checkpoint(str(tmp_path / "ck_sharded"))
    fast = backend("on")
    fast.load_checkpoint(str(tmp_path / "ck_sharded"))
    assert_close_states(master_state(fast), master_state(sharded), 0.0)
    assert fast.train_step(batch2, nll_loss)["actor/loss"] == pytest.approx(
        sharded.train_step(batch2, nll_loss)["actor/loss"], rel=1e-5
    )


def test_hf_export_writes_fp32_masters(tmp_path, monkeypatch, backend):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    monkeypatch.setattr(fsdp2_mod, "compute_dtype", lambda mode, device: torch.bfloat16)
    monkeypatch.setattr(fsdp2_mod, "mixed_precision", lambda mode, device: MixedPrecisionPolicy(torch.bfloat16))
    fast = backend("on")
    fast.train_step(make_batch(4), nll_loss)
    fast.save_hf(str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, dict(fast.named_weights())[name]), name


def test_weight_sync_from_the_fast_path_to_the_native_engine(backend, tiny_qwen3_lm):
    trainer = backend("on")
    trainer.train_step(make_batch(4), nll_loss)
    model = tiny_qwen3_lm(5, vocab_size=V, tie_word_embeddings=True)
    engine = NativeEngine(model, SimpleNamespace(eos_token_id=0, pad_token_id=0), max_batch_size=2, max_seq_len=32)
    streamed = dict(trainer_weights(trainer))
    state = dict(trainer.named_weights())
    assert [n for n, _ in trainer.model.named_parameters()] == list(streamed)
    stats = sync_to_engine(trainer, engine, version=4)
    assert stats.version == 4 and engine.weight_version == 4
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, state[name]), name  # the updated masters (fp32 compute on CPU)


@pytest.mark.parametrize("single", ["on", "off"], ids=["single-device", "fully_shard"])
def test_fused_adamw_clip_and_skip_match_the_host_path(single, monkeypatch, backend):
    """Fused AdamW (the CUDA setting, forced on CPU), single-device or through fully_shard (DTensor
    gradients): the norm, the clip as grad_scale and the skip as found_inf stay on the device (no host
    read), with the same results as the host path (fully_shard, non-fused AdamW)."""
    from lumenrl_backends.training import distributed as dist_utils

    batch = make_batch(4)
    host = backend("off")
    adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: adamw(*a, **{**k, "fused": True}))
    fused = backend(single)
    assert (fused.single is not None) == (single == "on")
    assert fused.optimizer.defaults["fused"] and not host.optimizer.defaults["fused"]
    reads = []
    monkeypatch.setattr(dist_utils, "as_float", lambda v: reads.append(v) or float(v))
    for _ in range(2):
        mf = fused.train_step(batch, nll_loss)
        assert not reads  # the fused path reads nothing back before the step's metrics
        mh = host.train_step(batch, nll_loss)
        assert reads  # the host path reads the norm and the loss
        reads.clear()
        assert mh["actor/grad_norm"] > 0.5  # clipping is active (grad_clip=0.5)
        assert set(mf) == set(mh) and "actor/skipped_steps" not in mf
        for key in mh:
            assert mf[key] == pytest.approx(mh[key], rel=1e-5, abs=1e-7), key
    assert_close_states(master_state(fused), master_state(host), 1e-5)

    def nan_loss(outputs, micro):
        loss, metrics = nll_loss(outputs, micro)
        return loss * float("nan"), metrics

    before = master_state(fused)
    steps = [s["step"].clone() for s in fused.optimizer.state.values()]
    mf, mh = fused.train_step(batch, nan_loss), host.train_step(batch, nan_loss)
    assert mf["actor/skipped_steps"] == mh["actor/skipped_steps"] == 1.0
    assert_close_states(master_state(fused), before, 0.0)  # the update was skipped on the device
    assert all(torch.equal(s["step"], t) for s, t in zip(fused.optimizer.state.values(), steps))
    if fused.single is not None:
        assert all(torch.equal(p, m) for p, m in zip(fused.model.parameters(), fused.single.masters))


@pytest.mark.parametrize("bf16", [False, True])
def test_one_rank_unshard_copy_equals_torchs_walk(bf16, monkeypatch, backend):
    """The root unit's one foreach cast-copy unshard (fsdp_one_rank) gives torch's results bit for bit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lumenrl_backends.training import parallelize as par

    if bf16:  # the CUDA setting, forced on CPU: bf16 compute weights cast from fp32 shards in the copy
        monkeypatch.setattr(fsdp2_mod, "mixed_precision",
                            lambda mode, device: MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    batch = make_batch(4)
    fast = backend("off")
    monkeypatch.setattr(par, "fast_one_rank_unshard", lambda model: "disabled")
    walk = backend("off")
    installed = [b.model._get_fsdp_state()._fsdp_param_group.__dict__.get("wait_for_unshard") for b in (fast, walk)]
    assert installed[0] is not None and installed[1] is None
    copies = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: copies.append(len(a[0])) or foreach_copy(*a, **k))
    for _ in range(3):
        mf = fast.train_step(batch, nll_loss)
        n_fast = len(copies)
        mw = walk.train_step(batch, nll_loss)
        assert mf == mw
    assert n_fast >= 1 and copies[0] == len(list(fast.model.parameters()))  # one copy of every parameter
    assert_close_states(master_state(fast), master_state(walk), 0.0)


@pytest.mark.parametrize("packing", ["auto", "none"])
def test_compiled_layers_have_no_graph_breaks(packing, backend):
    """Without fully_shard's hooks every decoder layer is one dynamo graph (packed and padded masks)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fast = backend("on", micro=4, compile_layers="eager", packing=packing)
    for _ in range(2):
        fast.train_step(make_batch(4), nll_loss)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    torch._dynamo.reset()


@pytest.mark.parametrize("packing", ["auto", "none"])
def test_compiled_layers_follow_changing_lengths_without_a_graph_per_length(packing, backend):
    """RL batches change length every step (responses end where they end). The layers compile static first and,
    at the first new length, once more with the length symbolic (dynamo's automatic dynamic shapes): after the
    second length (log-probs without grad, then an update), the next three lengths add no graph. Compiled static
    per length they added graphs at every step and hit dynamo's recompile limit in a 20-step GPU run (2026-12-07),
    which left the layers eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fast = backend("on", micro=4, compile_layers="eager", packing=packing)
    graphs = []
    for step, response in enumerate((3, 5, 6, 8, 11)):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, V, (4, P + response), generator=g)
        mask = torch.ones(4, response)
        mask[1, response // 2:] = 0
        batch = DataProto.from_dict(tensors={
            "input_ids": ids, "attention_mask": torch.cat([torch.ones(4, P, dtype=torch.long), mask.long()], 1),
            "responses": ids[:, P:], "response_mask": mask, "advantages": torch.randn(4, response, generator=g)})
        assert torch.isfinite(fast.compute_log_probs(batch)[0]).all()
        assert torch.isfinite(torch.tensor(fast.train_step(batch, nll_loss)["actor/loss"]))
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] >= 1 and graphs[1] == graphs[-1], graphs  # compiled graphs after each length
    torch._dynamo.reset()


@pytest.mark.parametrize("bf16", [False, True])
def test_one_rank_reduce_scatter_skips_the_gradient_copy_and_equals_torchs(bf16, monkeypatch, backend):
    """The root unit's one-rank reduce-scatter output is its input buffer (fsdp_one_rank.OneRankReduceScatter),
    packed by one foreach copy instead of ``chunk_cat``: no copy of the whole flat gradient, and the same losses,
    metrics and master weights as torch's path bit for bit, over steps of two micro-batches each (the backend
    reduces once per step, after the last one). ``bf16``: the CUDA setting (bf16 gradients cast to fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lumenrl_backends.training import fsdp_one_rank as one_rank
    from lumenrl_backends.training import parallelize as par

    if bf16:
        monkeypatch.setattr(fsdp2_mod, "mixed_precision",
                            lambda mode, device: MixedPrecisionPolicy(torch.bfloat16, torch.float32))

    batch = make_batch(4)
    fast = backend("off", micro=2)
    monkeypatch.setattr(par, "fast_one_rank_reduce", lambda model: "disabled")
    torch_path = backend("off", micro=2)
    groups = [b.model._get_fsdp_state()._fsdp_param_group for b in (fast, torch_path)]
    comm = groups[0].__dict__.get("_lumenrl_reduce_scatter")
    assert comm is not None and "_lumenrl_reduce_scatter" not in groups[1].__dict__
    numel = sum(fp.sharded_param.numel() for fp in groups[0].fsdp_params)
    copies: list[tuple[int, bool]] = []  # (numel, onto itself) of every copy_ of a whole flat gradient
    copy_ = torch.Tensor.copy_

    def spy(self, src, *args, **kwargs):
        if self.dim() == 1 and self.numel() >= numel:
            copies.append((self.numel(), self is src))
        return copy_(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    packs: list[str] = []  # which copy-in packed each reduce's gradients: ours (foreach copy) or chunk_cat
    ours, chunk_cat = one_rank._one_rank_copy_in, torch.ops.fsdp.chunk_cat
    monkeypatch.setattr(one_rank, "_one_rank_copy_in", lambda *a: packs.append("ours") or ours(*a))
    monkeypatch.setattr(torch.ops.fsdp, "chunk_cat", lambda *a, **k: packs.append("chunk_cat") or chunk_cat(*a, **k))
    for step in range(3):
        before = len(copies)
        packs.clear()
        mf = fast.train_step(batch, nll_loss)
        fast_copies, fast_packs = copies[before:], list(packs)
        mt = torch_path.train_step(batch, nll_loss)
        torch_copies = copies[before + len(fast_copies):]
        assert mf == mt, step
        assert torch_copies and not any(same for _, same in torch_copies)  # torch: a real copy per backward
        assert all(same for _, same in fast_copies)  # ours: onto itself (ATen skips it)
        assert fast_packs == ["ours"] and packs[1:] == ["chunk_cat"]  # no chunk_cat host table on our unit
    assert comm.calls == 3  # one reduce per step: each one's output was its input
    assert_close_states(master_state(fast), master_state(torch_path), 0.0)


def test_one_rank_reduce_scatter_accumulates_across_synced_backwards():
    """Two backwards that both reduce (sync on for each) accumulate into the sharded gradients the same with the
    input-as-output reduce-scatter as with torch's copy, and a reduce never hands back an earlier buffer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lumenrl_backends.training import distributed as dist_utils
    from lumenrl_backends.training.fsdp_one_rank import fast_one_rank_reduce

    dist_utils.ensure_process_group(CPU)
    mesh = init_device_mesh("cpu", (1,))
    grads = []
    for fast in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
        fully_shard(model, mesh=mesh)
        if fast:
            assert fast_one_rank_reduce(model) is None
        seen = []
        for seed in (1, 2):  # two synced backwards before any optimizer step
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
            model(x).square().sum().backward()
            seen.append({p.grad.to_local().untyped_storage().data_ptr() for p in model.parameters()})
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        if fast:
            comm = model._get_fsdp_state()._fsdp_param_group._lumenrl_reduce_scatter
            assert comm.calls == 2 and seen[0] == seen[1]  # the second reduce added into the first's gradients
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
