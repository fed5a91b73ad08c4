"""SDDD end to end on CPU: a tiny teacher trained on lumenrl-sddd's structured corpus, Eagle3 and DFlash
drafts trained on its captured hidden states, and real speculative decoding in the native engine.

Shown here: speculative greedy output == the teacher's own greedy output (untrained and trained drafts);
speculative sampling reproduces the teacher's distribution (chi-square, alpha = 1e-3); a trained Eagle3
draft reaches tau >= 3 with 5 draft tokens (untrained ~1); DFlash beats its untrained self; the engine's
capture equals an HF forward's; an exported Eagle3 draft reloads with the same tau.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.engines.speculative import attach_draft, capture_hidden
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_backends.trainers.sddd import measure_tau
from lumenrl_backends.trainers.sddd_teacher import prompt_batch
from lumenrl_sddd.capture import capture, dflash_layer_ids, eagle3_layer_ids, regenerate
from lumenrl_sddd.corpus import corpus_lines, encode_lines, prompts_from_lines, train_causal_lm
from lumenrl_sddd.dflash import DFlashDraft
from lumenrl_sddd.eagle3 import Eagle3Draft
from lumenrl_sddd.export import load_draft, save_draft
from lumenrl_sddd.vocab import token_counts

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU
K = 5


def _train(draft, cap, steps, loss_fn, lr=3e-3):
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        sel = torch.randint(0, cap["input_ids"].shape[0], (24,), generator=gen)
        loss, _ = loss_fn(draft, {k: v[sel] for k, v in cap.items()}, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    """Teacher with learned structure, its captures, trained + untrained drafts (built once)."""
    torch.manual_seed(0)
    path = tiny_model_dir("qwen3", num_hidden_layers=4)
    model, tok = load_model_and_tokenizer(str(path), dtype="float32")
    # 80 teacher steps, 60 Eagle3 and 40 DFlash steps: over seeds 0-4 (model, corpus and draft batches) the trained
    # Eagle3 tau is 3.8-5.1 (bound 3) and DFlash gains 0.8-1.5 (bound 0.3); 120/80/80 gave 3.1-4.4 and 1.3-2.6
    train_causal_lm(model, encode_lines(tok, corpus_lines(1000, seed=0), 48), pad_id=tok.pad_token_id, steps=80,
                    batch_size=16)
    prompts = prompts_from_lines(tok, corpus_lines(128, seed=1), 10)
    ids, mask = regenerate(model, prompts, max_new_tokens=36, pad_id=tok.pad_token_id)
    e_layers, d_layers = eagle3_layer_ids(4), dflash_layer_ids(4, 3)
    counts = token_counts(ids, mask, model.config.vocab_size)
    eagle = Eagle3Draft.from_teacher(model, counts=counts, draft_vocab_size=40, aux_layer_ids=e_layers, ttt_steps=K)
    dflash = DFlashDraft.from_teacher(model, aux_layer_ids=d_layers, block_size=K + 1, anchors_per_seq=6)
    untrained = {"eagle3": copy.deepcopy(eagle), "dflash": copy.deepcopy(dflash)}
    _train(eagle, capture(model, ids, mask, e_layers), 60, lambda d, b, g: d.ttt_loss(b))
    _train(dflash, capture(model, ids, mask, d_layers), 40, lambda d, b, g: d.block_loss(b, generator=g))
    return {"model": model, "tok": tok, "eagle3": eagle, "dflash": dflash, "untrained": untrained,
            "eval_prompts": prompts_from_lines(tok, corpus_lines(12, seed=2), 10)}


def _engine(world, **kw):
    return NativeEngine(world["model"], world["tok"], max_batch_size=kw.pop("max_batch_size", 16), max_seq_len=96, **kw)


def _tau(world, draft, k=K):
    return measure_tau(_engine(world), draft, world["eval_prompts"], k=k, max_new_tokens=36,
                       pad_id=world["tok"].pad_token_id)


@pytest.mark.parametrize("which", ["eagle3", "dflash", "untrained_eagle3"])
def test_greedy_speculative_is_lossless(world, which):
    draft = world["untrained"]["eagle3"] if which == "untrained_eagle3" else world[which]
    engine = _engine(world, max_batch_size=8)  # 12 prompts: two chunks
    batch = prompt_batch(world["eval_prompts"], world["tok"].pad_token_id)
    plain = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 30})
    attach_draft(engine, draft, K)
    spec = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 30})
    assert torch.equal(spec.batch["responses"], plain.batch["responses"])
    assert torch.allclose(spec.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-4)
    assert list(spec.non_tensor_batch["finish_reason"]) == list(plain.non_tensor_batch["finish_reason"])
    assert not engine.spec_rounds.graphs.record  # a compiled draft may compile for a new key: no recording


def test_speculative_decoding_honours_per_row_max_new_tokens(world):
    """The input column max_new_tokens (a dataset field) caps each row, as in plain decoding."""
    engine = _engine(world, max_batch_size=8)
    batch = prompt_batch(world["eval_prompts"][:4], world["tok"].pad_token_id)
    batch["max_new_tokens"] = np.array([3, 9, 1, 14])
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    plain = engine.generate(batch, params)
    attach_draft(engine, world["eagle3"], K)
    spec = engine.generate(batch, params)
    assert spec.batch["response_mask"].sum(1).tolist() == [3, 9, 1, 14]
    perf = spec.meta_info["perf"]
    assert 0 < perf["prefill_seconds"] < perf["seconds"]  # the prompt's forward and context commit, timed apart
    assert torch.equal(spec.batch["responses"], plain.batch["responses"])


def test_trained_eagle3_reaches_tau_3_and_dflash_beats_untrained(world):
    tau_eagle, tau_untrained = _tau(world, world["eagle3"]), _tau(world, world["untrained"]["eagle3"])
    assert tau_untrained < 1.5 and tau_eagle >= 3.0, (tau_untrained, tau_eagle)
    tau_dflash, tau_dflash0 = _tau(world, world["dflash"]), _tau(world, world["untrained"]["dflash"])
    print(f"tau eagle3 {tau_untrained:.2f} -> {tau_eagle:.2f}, dflash {tau_dflash0:.2f} -> {tau_dflash:.2f} (k={K})")
    assert tau_dflash > tau_dflash0 + 0.3, (tau_dflash0, tau_dflash)


def test_exported_eagle3_reloads_with_same_tau(world, tmp_path):
    save_draft(world["eagle3"], tmp_path / "eagle3")
    back = load_draft(tmp_path / "eagle3")
    assert _tau(world, back) == _tau(world, world["eagle3"])


def test_engine_capture_matches_hf_forward(world):
    model, tok = world["model"], world["tok"]
    batch = prompt_batch(world["eval_prompts"][:5], tok.pad_token_id)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    ours = capture_hidden(_engine(world), ids, mask, [1, 2])
    ref = capture(model, ids, mask, [1, 2])
    real = mask.bool()
    assert torch.allclose(ours["hidden"][real], ref["hidden"][real], atol=1e-4)
    assert torch.allclose(ours["logits"][real], ref["logits"][real], atol=1e-4)


def test_speculative_sampling_matches_teacher_distribution(world):
    """First two response tokens at temperature 1: chi-square of 3072 speculative samples against the
    teacher's exact joint p(x1) p(x2 | x1) (cells with expected count >= 5, rest pooled), alpha = 1e-3.
    The untrained draft is wrong almost always, so the residual path is exercised as much as acceptance."""
    model, tok = world["model"], world["tok"]
    prompt = world["eval_prompts"][0][:6]
    n = 3072
    engine = _engine(world, max_batch_size=512)
    attach_draft(engine, world["untrained"]["eagle3"], 3)
    out = engine.generate(prompt_batch([prompt] * n, tok.pad_token_id),
                          {"temperature": 1.0, "max_new_tokens": 2, "ignore_eos": True, "seed": 11})
    pairs = out.batch["responses"][:, :2]
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)  # (V,)
        vocab = p1.numel()
        cont = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2 = model(cont).logits[:, -1].double().softmax(-1)  # (V, V)
    expected = (p1[:, None] * p2 * n).flatten()
    observed = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = int(big.sum())
    assert dof >= 3
    chi2 = pytest.importorskip("scipy.stats").chi2
    assert stat < chi2.ppf(1 - 1e-3, dof), (stat, dof)


def test_rl_rollout_with_draft_path_and_online_sddd(world, tmp_path):
    """policy.rollout.speculative.draft_path attaches the draft in NativeEngine.from_config; online SDDD then
    trains it on a rollout batch (captured under the engine's weights) and decoding stays lossless."""
    from lumenrl_backends.trainers.sddd_online import online_sddd
    from lumenrl_core.config import config_from_dict

    save_draft(world["untrained"]["eagle3"], tmp_path / "draft")
    cfg = config_from_dict({"policy": {"dtype": "float32", "rollout": {"max_batch_size": 16, "cuda_graphs": False,
                            "speculative": {"draft_path": str(tmp_path / "draft"), "num_draft_tokens": 4,
                                            "online_sddd_steps": 3, "online_sddd_lr": 3e-3}}}})
    engine = NativeEngine.from_config(cfg, world["model"], world["tok"])
    assert engine.draft is not None and engine.spec_tokens == 4
    batch = prompt_batch(world["eval_prompts"], world["tok"].pad_token_id)
    rollout = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 20})
    before = engine.draft.fc.weight.detach().clone()
    metrics = online_sddd(engine, rollout, cfg.policy.rollout.speculative)
    assert metrics["sddd/online_steps"] == 3 and torch.isfinite(torch.tensor(metrics["sddd/online_loss"]))
    assert not torch.equal(before, engine.draft.fc.weight)
    again = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 20})
    assert torch.equal(again.batch["responses"], rollout.batch["responses"])


def test_speculative_prefill_at_bucketed_shapes_is_lossless(world):
    """Speculative decoding takes its prompt forward (and the draft's context features) from the engine's prefill;
    at the bucketed shapes that CUDA graphs replay (more left padding, rows repeated) it stays lossless."""
    engine = _engine(world, max_batch_size=8)
    batch = prompt_batch(world["eval_prompts"][:5], world["tok"].pad_token_id)  # 5 rows: bucket 8
    params = {"temperature": 0.0, "max_new_tokens": 30}
    plain = engine.generate(batch, params)
    keys: list[tuple] = []
    step = engine.prefill.graphs.step
    engine.prefill.buckets = True
    engine.prefill.graphs.step = lambda *key: keys.append(key) or step(*key)
    attach_draft(engine, world["eagle3"], K)
    spec = engine.generate(batch, params)
    assert [key[:2] for key in keys] == [(8, 16)] and keys[0][2] == tuple(world["eagle3"].layer_ids)
    assert torch.equal(spec.batch["responses"], plain.batch["responses"])
    assert torch.allclose(spec.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-4)


def test_speculative_decoding_refuses_route_recording(tiny_model_dir, world):
    """R3 records routes in plain decoding only: a draft attached to a recording engine is refused."""
    model, tok = load_model_and_tokenizer(str(tiny_model_dir("qwen3_moe")), dtype="float32")
    engine = NativeEngine(model, tok, max_batch_size=2, max_seq_len=64, record_routes=True)
    with pytest.raises(ValueError, match="moe.r3.enabled"):
        attach_draft(engine, world["eagle3"], K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_speculative_greedy_lossless_and_tau(world):
    """On CUDA (fp32 teacher, plain decode with its CUDA graphs): speculative greedy equals plain greedy and the
    trained Eagle3 draft keeps its tau."""
    model = copy.deepcopy(world["model"]).cuda()
    engine = NativeEngine(model, world["tok"], device="cuda", max_batch_size=16, max_seq_len=96)
    batch = prompt_batch(world["eval_prompts"], world["tok"].pad_token_id)
    plain = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 30})
    attach_draft(engine, copy.deepcopy(world["eagle3"]), K)
    spec = engine.generate(batch, {"temperature": 0.0, "max_new_tokens": 30})
    assert torch.equal(spec.batch["responses"], plain.batch["responses"])
    assert spec.meta_info["speculative"]["tau"] >= 3.0
    assert spec.meta_info["perf"]["cuda_graphs"] and engine.spec_rounds.graphs.error is None
    assert engine.draft.compiled == "inductor"  # chained steps compiled (compile_draft default), no fallback


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_speculative_rounds_in_cuda_graphs_equal_eager(world, temperature):
    """The captured rounds (draft + verify + acceptance) give the eager rounds' tokens and log-probs, in
    greedy and in sampling mode (counter-based noise: the same draws)."""
    batch = prompt_batch(world["eval_prompts"], world["tok"].pad_token_id)
    params = {"temperature": temperature, "max_new_tokens": 30, "seed": 5}
    outs = []
    for graphs in (False, True):
        engine = NativeEngine(copy.deepcopy(world["model"]).cuda(), world["tok"], device="cuda", max_batch_size=16,
                              max_seq_len=96, cuda_graphs=graphs)
        engine.prefill.buckets = True  # eager too: the graphed prefill's bucketed shapes
        attach_draft(engine, copy.deepcopy(world["eagle3"]), K)
        outs.append([engine.generate(batch, params) for _ in range(2)])  # the second call replays the graphs
    (eager, _), (captured, replayed) = outs
    assert replayed.meta_info["perf"]["cuda_graphs"] and not eager.meta_info["perf"]["cuda_graphs"]
    assert engine.prefill.graphs.graphs and engine.prefill.graphs.error is None
    for out in (captured, replayed):
        assert torch.equal(out.batch["responses"], eager.batch["responses"])
        assert torch.allclose(out.batch["rollout_log_probs"], eager.batch["rollout_log_probs"], atol=1e-5)
