"""RL trainer phases on synthetic batches: grouping, dynamic sampling, scoring, loss glue."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lumenrl_backends.trainers.rollout import (
    collect_rollouts,
    concat_rounds,
    expand_groups,
    generate,
    keep_first_groups,
    sampling_seed,
)
from lumenrl_backends.trainers.scoring import Scorer, scores_on_last_token
from lumenrl_backends.trainers.update import actor_loss_fn, apply_rollout_correction
from lumenrl_core.algorithms import PPOClipLoss
from lumenrl_core.config import AlgorithmConfig
from lumenrl_core.data_proto import DataProto


def _prompts(n: int, width: int = 3) -> DataProto:
    ids = torch.arange(n * width).reshape(n, width) + 10
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        {"ground_truth": [str(i) for i in range(n)], "raw_prompt": [f"p{i}" for i in range(n)]},
    )


class _ScriptedEngine:
    """Responds with one token per row: the row's ground truth digit if 'correct' else 0.

    ``plan`` maps a prompt's ground truth to per-sample correctness within its group.
    """

    def __init__(self, width: int) -> None:
        self.width, self.calls = width, []

    def generate(self, batch: DataProto, sampling: dict) -> DataProto:
        self.calls.append(dict(sampling))
        B, P = batch.batch["input_ids"].shape
        T = self.width
        responses = torch.zeros(B, T, dtype=torch.long)
        truth = batch.non_tensor_batch["ground_truth"]
        for i in range(B):  # prompts with even ground truth: all correct; odd: alternate
            good = int(truth[i]) % 2 == 0 or i % 2 == 0
            responses[i, 0] = 1 if good else 2
        mask = torch.zeros(B, T, dtype=torch.long)
        mask[:, 0] = 1
        return DataProto.from_dict({
            "prompts": batch.batch["input_ids"], "responses": responses, "response_mask": mask,
            "input_ids": torch.cat([batch.batch["input_ids"], responses], 1),
            "attention_mask": torch.cat([batch.batch["attention_mask"], mask], 1),
            "rollout_log_probs": torch.zeros(B, T),
        })


def _score(batch: DataProto) -> dict[str, float]:
    raw = (batch.batch["responses"][:, 0] == 1).float()
    batch["token_level_scores"] = scores_on_last_token(raw.tolist(), batch.batch["response_mask"])
    return {"reward/mean": raw.mean().item()}


def test_expand_groups_interleaves_rows_with_one_uid_per_prompt():
    out = expand_groups(_prompts(3), 4, group_tag="s1r0")
    assert list(out.non_tensor_batch["uid"]) == [f"s1r0-{i}" for i in range(3) for _ in range(4)]
    assert list(out.non_tensor_batch["ground_truth"]) == [str(i) for i in range(3) for _ in range(4)]
    with pytest.raises(ValueError, match="policy.rollout.n"):
        expand_groups(_prompts(1), 0, group_tag="x")


def test_sampling_seeds_differ_per_step_and_round_and_repeat():
    seeds = {sampling_seed(1, s, r) for s in range(50) for r in range(4)}
    assert len(seeds) == 200 and sampling_seed(1, 3, 1) == sampling_seed(1, 3, 1)


def test_dynamic_sampling_drops_uniform_groups_and_refills():
    loader_calls = iter(range(100))

    def next_prompts() -> DataProto:
        k = next(loader_calls)
        p = _prompts(4)
        p["ground_truth"] = np.array([str(4 * k + i) for i in range(4)], dtype=object)
        return p

    engine = _ScriptedEngine(width=2)
    result = collect_rollouts(
        next_prompts=next_prompts, engine=engine, score=_score, sampling={"temperature": 1.0, "n": 2},
        n=2, run_seed=7, step=3, target_groups=4, dynamic_sampling=True, max_num_gen_batches=5,
    )
    # each round has 2 odd (mixed) groups out of 4: two rounds fill 4 groups
    assert len(engine.calls) == 2 and result.metrics["dapo/kept_groups"] == 4.0
    assert len(result.batch) == 8 and all(int(g) % 2 == 1 for g in result.batch.non_tensor_batch["ground_truth"])
    assert engine.calls[0]["seed"] != engine.calls[1]["seed"] and "n" not in engine.calls[0]
    assert result.metrics["reward/mean"] == pytest.approx(0.75)  # first round, before filtering
    assert result.generated_tokens == 16


def test_dynamic_sampling_stops_at_the_generation_bound():
    engine = _ScriptedEngine(width=2)
    result = collect_rollouts(
        next_prompts=lambda: _prompts(4), engine=engine, score=_score, sampling={}, n=2, run_seed=0, step=1,
        target_groups=8, dynamic_sampling=True, max_num_gen_batches=3,
    )
    assert len(engine.calls) == 3 and result.metrics["dapo/gen_batches"] == 3.0
    assert len(set(result.batch.non_tensor_batch["uid"])) == 6  # 2 mixed groups per round, not full


def test_rollout_marks_prompts_generate_and_score_in_a_profiler_trace():
    """Each round's prompt fetch, generation and scoring are ``lumenrl/<phase>`` ranges of a torch.profiler
    trace, as the trainer's PhaseTimer phases are, so a profiled step attributes the GPU's idle time to them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        collect_rollouts(next_prompts=lambda: _prompts(4), engine=_ScriptedEngine(width=2), score=_score, sampling={},
                         n=2, run_seed=0, step=1, target_groups=8, dynamic_sampling=True, max_num_gen_batches=2)
    names = [e.name for e in prof.events() if e.name.startswith("lumenrl/")]
    assert names.count("lumenrl/prompts") == names.count("lumenrl/generate") == names.count("lumenrl/score") == 2


def test_concat_rounds_pads_prompt_left_and_response_right():
    a = _ScriptedEngine(width=2).generate(_prompts(2, width=3), {})
    b = _ScriptedEngine(width=4).generate(_prompts(2, width=5), {})
    out = concat_rounds([a, b], pad_token_id=0)
    assert out.batch["prompts"].shape == (4, 5) and out.batch["responses"].shape == (4, 4)
    assert out.batch["input_ids"].shape == (4, 9)
    assert torch.equal(out.batch["attention_mask"][0], torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 0]))
    assert torch.equal(out.batch["input_ids"][0, 2:6], a.batch["input_ids"][0, :4])


def test_keep_first_groups_cuts_at_group_boundaries():
    batch = expand_groups(_prompts(3), 2, group_tag="g")
    assert list(keep_first_groups(batch, 2).non_tensor_batch["uid"]) == ["g-0", "g-0", "g-1", "g-1"]


def test_scorer_places_reward_on_last_token_and_shapes_overlong():
    tok = SimpleNamespace(batch_decode=lambda rows, skip_special_tokens: ["".join(map(str, r)) for r in rows])
    batch = DataProto.from_dict(
        {"responses": torch.tensor([[7, 0, 0, 0], [7, 7, 7, 7]]), "response_mask": torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])},
        {"raw_prompt": ["a", "b"], "extra": [{"ground_truth": "7"}, {"ground_truth": "7777"}]},
    )
    seen = {}

    def reward(prompts, responses, extra):
        seen.update(prompts=prompts, responses=responses, extra=extra)
        return [1.0 if r == e["ground_truth"] else 0.0 for r, e in zip(responses, extra)]

    scorer = Scorer(reward_fn=reward, tokenizer=tok, max_response_length=4, overlong_buffer_len=2)
    metrics = scorer(batch)
    assert seen["responses"] == ["7", "7777"] and seen["extra"][1] == {"ground_truth": "7777"}
    # row 1: length 4 > 4 - 2 -> penalty -(4 - 2) / 2 * 1 = -1 added on its last token
    assert torch.equal(batch.batch["token_level_scores"], torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0.0]]))
    assert metrics["reward/mean"] == 1.0 and metrics["dapo/overlong_frac"] == 0.5


def test_scorer_reads_the_engines_response_text_without_decoding_again():
    def no_decode(rows, skip_special_tokens):
        raise AssertionError("the engine's response_text should be used")

    batch = DataProto.from_dict(
        {"responses": torch.tensor([[5, 6], [9, 0]]), "response_mask": torch.tensor([[1, 1], [1, 0]])},
        {"response_text": ["56", "9"], "ground_truth": ["56", "8"]},
    )
    scorer = Scorer(
        reward_fn=lambda p, r, e: [float(t == x["ground_truth"]) for t, x in zip(r, e)],
        tokenizer=SimpleNamespace(batch_decode=no_decode),
        max_response_length=2,
    )
    assert scorer(batch)["reward/mean"] == 0.5
    assert torch.equal(batch.batch["token_level_scores"], torch.tensor([[0.0, 1.0], [0.0, 0.0]]))


def _reference_actor_loss(lp, old, adv, ref, ent, mask, eps_lo, eps_hi, kl_coef, ent_coef):
    """float64 token-mean PPO-clip (+dual clip c=3) + kl_coef * k3 - ent_coef * entropy."""
    lp, old, adv, ref, ent, m = (t.double() for t in (lp, old, adv, ref, ent, mask))
    ratio = torch.exp(lp - old)
    clip = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_lo, 1 + eps_hi))
    pg = torch.where(adv < 0, torch.minimum(clip, -adv * 3.0), clip)
    d = lp - ref
    k3 = torch.exp(-d) + d - 1
    n = m.sum()
    return (pg * m).sum() / n + kl_coef * (k3 * m).sum() / n - ent_coef * (ent * m).sum() / n


def test_actor_loss_summed_over_micro_batches_equals_the_mini_batch_loss():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    lp = -torch.rand(B, T, generator=g) * 2
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    ent = torch.rand(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, clip_ratio_high=0.28)
    loss_fn = actor_loss_fn(PPOClipLoss(clip_ratio_low=0.2, clip_ratio_high=0.28), algo)
    total = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 6)):
        micro = SimpleNamespace(
            batch={"old_log_probs": old[rows], "advantages": adv[rows], "ref_log_probs": ref[rows],
                   "response_mask": mask[rows]},
            meta_info={"mini_batch_tokens": float(mask.sum()), "mini_batch_seqs": B},
        )
        loss, metrics = loss_fn({"log_probs": lp[rows], "entropy": ent[rows]}, micro)
        total = total + loss
        assert {"actor/pg_loss", "actor/kl", "actor/entropy", "actor/clip_frac"} <= set(metrics)
    expected = _reference_actor_loss(lp, old, adv, ref, ent, mask, 0.2, 0.28, 0.1, 0.01)
    assert abs(total.double().item() - expected.item()) < 1e-6 * max(1.0, abs(expected.item()))


def _actor_micro(device: str = "cpu", seed: int = 3, b: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 2
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    mask[:, 0] = 1
    batch = {"old_log_probs": lp + 0.3 * torch.randn(b, t, generator=g), "advantages": torch.randn(b, t, generator=g),
             "ref_log_probs": lp + 0.2 * torch.randn(b, t, generator=g), "response_mask": mask}
    micro = SimpleNamespace(batch={k: v.to(device) for k, v in batch.items()},
                            meta_info={"mini_batch_tokens": float(mask.sum()) + 7.0, "mini_batch_seqs": b + 2})
    return {"log_probs": lp.to(device).requires_grad_(), "entropy": torch.rand(b, t, generator=g).to(device)}, micro


@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_actor_metrics_stay_tensors_until_the_backend_reads_them(use_kl_loss):
    """The built-in loss leaves every metric a 0-dim tensor (the backend reads them back once per step); a
    policy-loss plugin without ``sync_metrics`` is called as before and its floats pass through."""
    algo = AlgorithmConfig(use_kl_loss=use_kl_loss, kl_loss_coef=0.1, entropy_coef=0.01)
    outputs, micro = _actor_micro()
    loss, metrics = actor_loss_fn(PPOClipLoss(), algo)(outputs, micro)
    assert {"actor/pg_loss", "actor/kl", "actor/entropy", "actor/clip_frac"} <= set(metrics)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values()), metrics
    # pg_loss is rescaled from the mini-batch denominator to this micro-batch's own token mean
    mask = micro.batch["response_mask"].double()
    _, plain = PPOClipLoss()(outputs["log_probs"].detach(), micro.batch["old_log_probs"], micro.batch["advantages"],
                             micro.batch["response_mask"])
    assert float(metrics["actor/pg_loss"]) == pytest.approx(plain["actor/pg_loss"], rel=1e-6)
    assert float(metrics["actor/entropy"]) == pytest.approx(
        float((outputs["entropy"].double() * mask).sum() / mask.sum()), rel=1e-6)

    def floats_only(log_probs, old, advantages, mask, is_weights=None, *, global_tokens=None, global_seqs=None):
        return (log_probs * mask).sum() / global_tokens, {"actor/pg_loss": 0.5, "actor/custom": 2.0}

    loss2, metrics2 = actor_loss_fn(floats_only, algo)(outputs, micro)
    assert metrics2["actor/custom"] == 2.0 and isinstance(metrics2["actor/pg_loss"], torch.Tensor)
    loss2.backward()
    assert outputs["log_probs"].grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_the_actor_and_critic_losses_queue_without_waiting_for_the_device(use_kl_loss):
    """No host read-back between a micro-batch's forward and its backward: under CUDA's sync debug mode
    'error' any synchronizing call (``item``, ``tolist``, a pageable host-to-device copy) raises."""
    from lumenrl_backends.trainers.update import critic_loss_fn

    algo = AlgorithmConfig(use_kl_loss=use_kl_loss, kl_loss_coef=0.1, entropy_coef=0.01)
    actor, critic = actor_loss_fn(PPOClipLoss(), algo), critic_loss_fn(
        SimpleNamespace(cliprange_value=0.5, value_loss_coef=0.5), "token-mean")
    outputs, micro = _actor_micro("cuda")
    micro.batch.update(values=micro.batch["old_log_probs"], returns=micro.batch["advantages"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = actor(outputs, micro)
        loss.backward()
        vloss, vmetrics = critic({"values": outputs["log_probs"]}, micro)
        vloss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(isinstance(v, torch.Tensor) for v in (*metrics.values(), *vmetrics.values()))
    assert torch.isfinite(outputs["log_probs"].grad).all()


def test_rollout_correction_weights_and_narrows_the_response_mask():
    def correction(old, rollout, mask):
        keep = ((old - rollout).abs() < 0.5).long() * mask
        return torch.exp(old - rollout).clamp(max=2.0), keep, {"rollout_correction/masked_frac": 0.5}

    batch = DataProto.from_dict({
        "old_log_probs": torch.tensor([[-1.0, -1.0]]), "rollout_log_probs": torch.tensor([[-1.1, -2.0]]),
        "response_mask": torch.tensor([[1, 1]]),
    })
    metrics = apply_rollout_correction(batch, correction)
    assert torch.equal(batch.batch["response_mask"], torch.tensor([[1, 0]]))
    assert torch.allclose(batch.batch["is_weights"], torch.tensor([[np.exp(0.1), 2.0]], dtype=torch.float32))
    assert metrics == {"rollout_correction/masked_frac": 0.5}
    assert apply_rollout_correction(batch, None) == {}


def test_warm_start_applies_to_builtin_demo_models_only(tmp_path):
    from lumenrl_backends.trainers.build import _policy_path
    from lumenrl_core.config import load_config

    base = tmp_path / "demo.yaml"  # a demo file's warm start under a later real-model override: reset (logged)
    base.write_text("trainer:\n  warm_start_sft_steps: 5\n")
    cfg = load_config(base, [f"policy.model_name={tmp_path}"])
    assert cfg.trainer.warm_start_sft_steps == 0
    cfg.trainer.warm_start_sft_steps = 5  # a RunConfig built in code is not checked at load: the trainer still skips
    logged: list[str] = []

    class _NeverBuilt:
        @classmethod
        def from_config(cls, *args, **kwargs):
            raise AssertionError("a real checkpoint must not be fine-tuned by the demo warm start")

    plan = SimpleNamespace(config=cfg, training_backend_cls=_NeverBuilt)
    assert _policy_path(plan, logged.append) == str(tmp_path)
    assert "skipped" in logged[0]


def test_a_per_prompt_max_new_tokens_column_is_refused_by_an_engine_that_does_not_read_it():
    prompts = _prompts(2)
    prompts["max_new_tokens"] = np.array([3, 5])
    engine = _ScriptedEngine(width=4)  # no row_max_new_tokens capability
    with pytest.raises(ValueError, match="max_new_tokens field .* not read by the _ScriptedEngine rollout engine"):
        generate(engine, prompts, {"temperature": 1.0}, seed=0)
    assert engine.calls == []  # refused before generating
    engine.capabilities = {"row_max_new_tokens"}
    out = generate(engine, prompts, {"temperature": 1.0}, seed=0)
    assert out.non_tensor_batch["max_new_tokens"].tolist() == [3, 5]
