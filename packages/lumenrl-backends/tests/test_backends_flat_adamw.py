"""Flat AdamW of the single-device path (Triton, interpreted on the CPU) against float64 and torch's AdamW."""

from __future__ import annotations

import warnings

import pytest
import torch

from lumenrl_backends.training import flat_adamw
from lumenrl_backends.training.single_device import SingleDeviceWeights

# Each case: a bf16-compute model whose parameters span several 4096-element blocks with ragged tails,
# AdamW with weight decay and active clipping, stepped by the flat kernels; a float64 AdamW on the same
# gradients (read before the step) is the reference, torch's fused AdamW on fp32 copies of the masters the peer.
_COMMON = r"""
import json, math
import torch
from lumenrl_backends.training.single_device import SingleDeviceWeights

LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.5


def make(flat):
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(37, 301), torch.nn.GELU(), torch.nn.Linear(301, 29))
    w = SingleDeviceWeights(model, torch.bfloat16)
    w.flat_optimizer = flat
    opt = torch.optim.AdamW(w.trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    return model, w, opt


def backward(model, w, micro, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(micro):
        x = torch.randn(8, 37, generator=g).bfloat16()
        model(x).float().square().mean().backward()
        w.accumulate_grads()


def grads64(w):
    if w._stash is not None:
        return [g.double() for g in w._stash]
    return [m.grad.double() for m in w.masters]


class Ref:  # float64 AdamW with clipping, the formulas of torch.optim.AdamW
    def __init__(self, masters):
        self.p = [m.detach().double().clone() for m in masters]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.zeros_like(p) for p in self.p]
        self.t = 0

    def step(self, grads):
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        coef = min(CLIP / (norm + 1e-6), 1.0)
        self.t += 1
        b1, b2 = BETAS
        for p, m, v, g in zip(self.p, self.m, self.v, grads):
            g = g * coef
            p.mul_(1 - LR * WD)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2 ** self.t)).sqrt() + EPS
            p.sub_(LR / (1 - b1 ** self.t) * m / denom)
        return norm


def err(ws, ref):
    return max(float((m.double() - r).abs().max() / r.abs().max()) for m, r in zip(ws.masters, ref))
"""

_STEPS = _COMMON + r"""
for micro in (1, 2):
    model, w, opt = make(True)
    ref = Ref(w.masters)
    # the peer: torch's fused AdamW stepping fp32 copies of the masters on the same gradients
    peer = [torch.nn.Parameter(m.detach().clone()) for m in w.masters]
    popt = torch.optim.AdamW(peer, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    rows = {"case": f"micro{micro}", "norm": [], "ref": [], "torch": [], "bf16_copy": True, "stashed": []}
    for step in range(4):
        w.zero_grad()
        backward(model, w, micro, step)
        rows["stashed"].append(w._stash is not None)
        grads = grads64(w)
        n_ref = ref.step(grads)
        for p, g in zip(peer, grads):
            p.grad = g.float()
        popt.grad_scale = torch.tensor(max((n_ref + 1e-6) / CLIP, 1.0), dtype=torch.float32)
        popt.found_inf = torch.tensor(0.0)
        popt.step()
        norm, skipped = w.fused_clip_and_step(opt, CLIP)
        rows["norm"].append(abs(float(norm) - n_ref) / n_ref)
        rows["ref"].append(err(w, ref.p))
        rows["torch"].append(err(w, [p.double() for p in peer]))
        rows["bf16_copy"] &= all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), w.masters))
        assert float(skipped) == 0.0
    state = opt.state[w.masters[0]]
    rows["moments"] = max(float((opt.state[m]["exp_avg"].double() - r).abs().max()) for m, r in zip(w.masters, ref.m))
    rows["steps"] = sorted({float(opt.state[m]["step"]) for m in w.masters})
    rows["views"] = state["exp_avg"].data_ptr() == w._flats[id(opt)][1].exp_avg.data_ptr()
    print(json.dumps(rows))
"""

_SKIP_AND_RESUME = _COMMON + r"""
model, w, opt = make(True)
for step in range(2):
    w.zero_grad(); backward(model, w, 1, step); w.fused_clip_and_step(opt, CLIP)
before = [m.detach().clone() for m in w.masters]
moments = [opt.state[m]["exp_avg_sq"].clone() for m in w.masters]
w.zero_grad(); backward(model, w, 1, 5)
norm, skipped = w.fused_clip_and_step(opt, CLIP, loss=torch.tensor(float("nan")))
unchanged = all(torch.equal(a, m) for a, m in zip(before, w.masters)) and all(
    torch.equal(a, opt.state[m]["exp_avg_sq"]) for a, m in zip(moments, w.masters))
w.zero_grad(); backward(model, w, 1, 6)
w._stash[0][0, 0] = float("inf")
_, skipped_inf = w.fused_clip_and_step(opt, CLIP)
print(json.dumps({"case": "skip", "skipped": [float(skipped), float(skipped_inf)], "unchanged": unchanged and all(
    torch.equal(a, m) for a, m in zip(before, w.masters)), "steps": sorted({float(opt.state[m]["step"]) for m in w.masters})}))

# resume: the optimizer state through state_dict into a fresh optimizer continues bit for bit
saved = {k: v for k, v in opt.state_dict().items()}
saved["state"] = {i: {n: t.clone() for n, t in s.items()} for i, s in saved["state"].items()}
masters = [m.detach().clone() for m in w.masters]
model2, w2, opt2 = make(True)
with torch.no_grad():
    for m2, m in zip(w2.masters, masters):
        m2.copy_(m)
    w2.copy_back()
opt2.load_state_dict(saved)
for step in (7, 8):
    for mm, ws, oo in ((model, w, opt), (model2, w2, opt2)):
        ws.zero_grad(); backward(mm, ws, 1, step); ws.fused_clip_and_step(oo, CLIP)
print(json.dumps({"case": "resume", "equal": all(torch.equal(a, b) for a, b in zip(w.masters, w2.masters)),
                  "steps": sorted({float(opt2.state[m]["step"]) for m in w2.masters})}))

# a fallback step (one parameter without a gradient) in between: steps differ, the flat path stands down
model3, w3, opt3 = make(True)
w3.zero_grad(); backward(model3, w3, 1, 0); w3.fused_clip_and_step(opt3, CLIP)
w3.zero_grad(); backward(model3, w3, 1, 1); w3._stash[1] = None
w3.fused_clip_and_step(opt3, CLIP)
w3.zero_grad(); backward(model3, w3, 1, 2); w3.fused_clip_and_step(opt3, CLIP)
print(json.dumps({"case": "fallback", "flat_after": w3._flats[id(opt3)][1] is not None,
                  "steps": [float(opt3.state[m]["step"]) for m in w3.masters]}))

# two optimizers over the same masters, alternating (an RL and an SFT step): each keeps its own flat state
model4, w4, oa = make(True)
ob = torch.optim.AdamW(w4.trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
for step, o in enumerate((oa, ob, oa, ob, oa)):
    w4.zero_grad(); backward(model4, w4, 1, step); w4.fused_clip_and_step(o, CLIP)
print(json.dumps({"case": "two", "built": len(w4._flats), "active": w4.flat_active,
                  "steps": [sorted({float(o.state[m]["step"]) for m in w4.masters}) for o in (oa, ob)],
                  "views": all(w4._flats[id(o)][1].exp_avg.data_ptr() == o.state[w4.masters[0]]["exp_avg"].data_ptr()
                               for o in (oa, ob))}))
"""


# the FSDP2 backend's single-device path with the flat stepper (forced on CPU): a DCP checkpoint after
# one step resumes into a fresh backend, and the next two steps equal the uninterrupted run's
_BACKEND_RESUME = r"""
import json, os, tempfile
# this process starts its own one-rank group: drop the rendezvous a parent test process may have set up
# (its store still listens on that MASTER_PORT)
for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
    os.environ.pop(key, None)
from unittest import mock
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from lumenrl_backends.training.fsdp2 import FSDP2Backend
from lumenrl_core.config.schema import OptimConfig, PolicyTrainConfig
from test_backends_fsdp2_single import V, make_batch, master_state, nll_loss


def backend(micro):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=V, tie_word_embeddings=True))
    adamw = torch.optim.AdamW
    with mock.patch.object(torch.optim, "AdamW", lambda *a, **k: adamw(*a, **{**k, "fused": True})):
        b = FSDP2Backend(model.float(), role="actor", optim=OptimConfig(lr=1e-2, grad_clip=0.5, weight_decay=0.1),
                         train=PolicyTrainConfig(micro_batch_size=micro, single_device="on"), num_training_steps=10,
                         device=torch.device("cpu"))
    b.single.flat_optimizer = True
    return b


batch, batch2 = make_batch(4), make_batch(4, seed=7)
for micro in (4, 2):
    with tempfile.TemporaryDirectory() as ck:
        first = backend(micro)
        first.train_step(batch, nll_loss)
        active = first.single.flat_active
        first.save_checkpoint(ck, extra={"step": 1})
        after = [first.train_step(batch2, nll_loss)["actor/loss"] for _ in range(2)]
        want = master_state(first)
        resumed = backend(micro)
        extra = resumed.load_checkpoint(ck)
        got = [resumed.train_step(batch2, nll_loss)["actor/loss"] for _ in range(2)]
        err = max(float((resumed_t - want[n]).abs().max()) for n, resumed_t in master_state(resumed).items())
        print(json.dumps({"case": f"micro{micro}", "active": [active, resumed.single.flat_active], "extra": extra,
                          "after": after, "got": got, "err": err}))
"""


def test_flat_adamw_matches_float64_and_torch(triton_interpreted):
    runs = triton_interpreted({"steps": _STEPS, "skip": _SKIP_AND_RESUME, "backend": _BACKEND_RESUME})
    rows = runs.json_rows("steps")
    for name, row in rows.items():
        # one micro-batch: the bf16 module grads are read in place; two: summed in fp32 first
        assert row["stashed"] == [name == "micro1"] * 4, (name, row)
        assert max(row["norm"]) < 1e-5, (name, row)
        assert max(row["ref"]) < 1e-5, (name, row)  # fp32 arithmetic vs float64 over 4 steps
        assert max(row["torch"]) < 1e-5, (name, row)
        assert row["moments"] < 1e-7 and row["bf16_copy"] and row["views"] and row["steps"] == [4.0], (name, row)
    other = runs.json_rows("skip")
    assert other["skip"]["skipped"] == [1.0, 1.0] and other["skip"]["unchanged"], other
    assert other["skip"]["steps"] == [2.0], other
    assert other["resume"]["equal"] and other["resume"]["steps"] == [4.0], other  # 2 + 2 skipped + 2
    # the fallback stepped 3 of 4 parameters; the flat path then refused unequal step counts
    assert not other["fallback"]["flat_after"] and other["fallback"]["steps"] == [3.0, 2.0, 3.0, 3.0], other
    assert other["two"] == {"built": 2, "active": True, "steps": [[3.0], [2.0]], "views": True}, other
    for name, row in runs.json_rows("backend").items():  # one micro-batch (grads read in place) and two
        assert row["active"] == [True, True] and row["extra"] == {"step": 1}, (name, row)
        assert row["got"] == pytest.approx(row["after"], rel=1e-6) and row["err"] < 1e-6, (name, row)


def test_unsupported_names_the_reason_and_the_torch_path_runs():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    w = SingleDeviceWeights(model, torch.float32)
    cases = {
        "not torch.optim.AdamW": torch.optim.Adam(w.trainable),
        "parameter groups": torch.optim.AdamW([{"params": w.trainable[:2]}, {"params": w.trainable[2:]}]),
        "amsgrad": torch.optim.AdamW(w.trainable, amsgrad=True),
        "tensor hyper-parameters": torch.optim.AdamW(w.trainable, lr=torch.tensor(1e-3)),
        "every master": torch.optim.AdamW(w.trainable[1:]),
    }
    for reason, opt in cases.items():
        problem = flat_adamw.unsupported(opt, w.masters)
        assert problem is not None and (reason in problem or not flat_adamw.available()), (reason, problem)
    hooked = torch.optim.AdamW(w.trainable)
    hooked.register_step_post_hook(lambda *a: None)
    assert flat_adamw.unsupported(hooked, w.masters) is not None
    if flat_adamw.available():
        assert flat_adamw.unsupported(torch.optim.AdamW(w.trainable), w.masters) is None
    # a stash that an unsupported optimizer's path must see as fp32 master gradients
    w.flat_optimizer = True
    model(torch.randn(5, 4)).sum().backward()
    w.accumulate_grads()
    assert w._stash is not None and all(m.grad is None for m in w.masters)
    expected = [g.clone() for g in w._stash]
    opt = torch.optim.AdamW(w.trainable[1:], fused=True)  # a parameter left out: flat path refused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm, skipped = w.fused_clip_and_step(opt, 1.0)
    assert float(skipped) == 0.0 and w._stash is None
    assert all(m.grad is not None for m in w.masters)  # moved into the fp32 master gradients
    assert float(norm) == pytest.approx(float(torch.linalg.vector_norm(torch.cat([e.flatten() for e in expected]))))


@pytest.mark.skipif(not torch.cuda.is_available() or not flat_adamw.available(), reason="needs CUDA and triton")
def test_flat_adamw_on_cuda_matches_torch_fused():
    """A Qwen3-sized embedding (151936 x 256) plus layers, 3 steps of the flat kernels (bf16 grads read in
    place) vs torch's fused AdamW stepping fp32 copies of the masters on the same gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(151936, 256), torch.nn.Linear(256, 1000),
                                torch.nn.Linear(1000, 256)).cuda()
    w = SingleDeviceWeights(model, torch.bfloat16)
    opt = torch.optim.AdamW(w.trainable, lr=1e-3, weight_decay=0.1, fused=True)
    peer = [torch.nn.Parameter(m.detach().clone()) for m in w.masters]
    popt = torch.optim.AdamW(peer, lr=1e-3, weight_decay=0.1, fused=True)
    assert w.flat_optimizer
    ids = torch.randint(0, 151936, (16, 64), device="cuda")
    for _ in range(3):
        w.zero_grad()
        model(ids).float().square().mean().backward()
        w.accumulate_grads()
        grads = [g.double() for g in w._stash]
        norm64 = float(torch.stack([g.norm() for g in grads]).norm())
        for p, g in zip(peer, grads):
            p.grad = g.float()
        popt.grad_scale = torch.tensor(max((norm64 + 1e-6) / 0.5, 1.0), device="cuda")
        popt.found_inf = torch.zeros((), device="cuda")
        popt.step()
        norm, skipped = w.fused_clip_and_step(opt, 0.5)
        assert w.flat_active and float(skipped) == 0.0
        assert abs(float(norm) - norm64) < 1e-5 * norm64
    for a, b in zip(w.masters, peer):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    for p, m in zip(model.parameters(), w.masters):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_gradient_addresses_are_reused_while_they_match():
    """The device copy of the gradients' addresses is made again only when a gradient moved."""
    masters = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    flat = torch.cat([m.detach().flatten() for m in masters])
    slices = [(0, 5, masters[0].shape), (5, 6, masters[1].shape)]
    f = flat_adamw.FlatAdamW(torch.optim.AdamW(masters), masters, slices, flat, flat.clone())
    grads = [torch.randn(5), torch.randn(3, 2)]
    first = f._addresses(grads)
    assert first.tolist() == [g.data_ptr() for g in grads]
    assert f._addresses(list(grads)) is first  # same buffers: no new tensor, no copy
    moved = [grads[0], torch.randn(3, 2)]
    second = f._addresses(moved)
    assert second is not first and second.tolist() == [g.data_ptr() for g in moved]
