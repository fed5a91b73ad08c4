"""R3 routes through the async trainer's partial rollout (issue #18 x #17).

A tiny Qwen3-MoE (``lumenrl:tiny-qwen3_moe``) trained by ``async_rl`` with ``partial_rollout``,
``moe.r3.enabled`` and a weight sync after every update, long responses (up to 48 tokens) so
syncs land while sequences are being generated (rows stop at EOS at different lengths, so some
groups are interrupted half finished): the rollouter interrupts them and resumes them under
the new weights. The invariant checked on every trained sample (resumed or not):

* its ``routed_experts`` hold, at every position fed to the model (prompt and response but the last
  token), the experts the router picks in one forward of the whole sequence under the weights of the
  sample's newest token version: a resumed sequence is re-prefilled under the new weights, so its
  routes are those of the last generate call, for old and new tokens alike (aligned with its tokens,
  none missing; rows of a partially finished group that finished earlier keep their own routes);
* replaying those routes under those weights reproduces ``rollout_log_probs`` of the tokens generated
  by that last call (the weights did not change for them); tokens generated before the interrupt
  came from older weights and are off-policy by design (their versions are in ``token_versions``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lumenrl_backends.loggers import read_metrics
from lumenrl_core.assembly import plan_run
from lumenrl_core.assembly.requirements import moe_layout_supported
from lumenrl_core.config import load_config

pytestmark = pytest.mark.skipif(not moe_layout_supported(),
                                reason="needs the transformers >= 5.13 MoE layout (router module + fused experts)")

PRESET = Path(__file__).resolve().parents[1] / "configs" / "grpo_moe_r3.yaml"
ARGS = ("trainer.name=async_rl", "async_training.enabled=true", "async_training.partial_rollout=true",
        "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1.0",
        "num_training_steps=6", "dataset.train_batch_size=2", "policy.rollout.n=4", "policy.rollout.max_new_tokens=48",
        "policy.optim.lr=3e-2", "logger.backends=[jsonl]",
        "logger.progress_bar=false", "checkpointing.enabled=false", "checkpointing.export_hf=false")
REWARD = '''
def sevens(prompts, responses, extra):
    return [sum(c == "7" for c in r) / max(len(r), 1) for r in responses]
'''
KEYS = ("prompts", "attention_mask", "responses", "response_mask", "routed_experts", "rollout_log_probs",
        "token_versions")


def _run(out: Path) -> tuple[list[dict], dict[int, dict], Path]:
    out.mkdir(parents=True)
    (out / "reward7.py").write_text(REWARD)  # a reward random responses differ on: the weights move every step
    plan = plan_run(load_config(str(PRESET), [f"trainer.output_dir={out}", f"reward.function={out / 'reward7.py'}:sevens",
                                              *ARGS]))
    trainer = plan.trainer_cls.from_plan(plan)
    trained, published = [], {}
    writer, update = trainer.publisher.writer, trainer._update

    def publish(named, version):  # keep every version's weights (InProcessWeightSync keeps the newest)
        writer_publish(named, version)
        published[version] = writer.latest()[1]

    def capture(batch, timer):
        trained.append({**{k: batch.batch[k].clone() for k in KEYS}, "uid": batch.non_tensor_batch["uid"].copy(),
                        "published": trainer.published})
        return update(batch, timer)

    writer_publish, writer.publish, trainer._update = writer.publish, publish, capture
    trainer.fit()
    return trained, published, Path(trainer.model_path)


def _model(path: Path, weights: dict):
    from transformers import AutoModelForCausalLM

    from lumenrl_moe import install_routing

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model, install_routing(model)


def _rows(batch: dict):
    """(ids (S,), fed routes (S - 1, L, k), rollout log-probs (R,), token versions (R,)) per row."""
    P = batch["prompts"].shape[1]
    for b in range(batch["prompts"].shape[0]):
        prompt = batch["prompts"][b][batch["attention_mask"][b, :P].bool()]
        keep = batch["response_mask"][b].bool()
        response = batch["responses"][b][keep]
        lo, S = P - len(prompt), len(prompt) + len(response)
        yield (torch.cat([prompt, response]), batch["routed_experts"][b, lo : lo + S - 1],
               batch["rollout_log_probs"][b][keep], batch["token_versions"][b][keep], len(prompt))


def _lags(batch: dict) -> tuple[list[int], list[int]]:
    """Per trained sample: syncs (one per step here) behind the trainer from the version that finished its
    group (its newest token's, over the group's rows) and from its own oldest token."""
    finish, oldest = [], []
    mask = batch["response_mask"].bool()
    for uid in dict.fromkeys(batch["uid"]):
        rows = torch.as_tensor(batch["uid"] == uid)
        tv = batch["token_versions"][rows]
        newest = int(tv[mask[rows]].max())
        finish += [batch["published"] - newest] * int(rows.sum())
        oldest += [batch["published"] - int(t[m].min()) for t, m in zip(tv, mask[rows])]
    return finish, oldest


def test_partial_rollout_keeps_r3_routes_aligned_and_replayable(tmp_path):
    trained, published, path = _run(tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert len(records) == 6 and records[-1]["async/partial_rollouts_total"] > 0  # interrupts really happened
    assert records[-1]["async/interrupts_total"] > 0
    last = records[-1]  # the rollouter's calls (each interrupt ends one) and its prefill time within its busy time
    assert last["async/rollouter_calls_total"] > last["async/interrupts_total"]
    assert 0 < last["async/rollouter_prefill_s_total"] < last["async/rollouter_busy_s_total"]
    # staleness_from=finish (the default): the bound (1 sync) holds from the weights that finished each group;
    # the metrics report that lag and each sample's oldest token's, as recomputed from the trained tokens
    for batch, record in zip(trained, records):
        finish, oldest = _lags(batch)
        assert max(finish) <= 1 and all(o >= f for o, f in zip(oldest, finish))
        assert (record["async/staleness_max"], record["async/staleness_oldest_max"]) == (max(finish), max(oldest))
    models = {v: _model(path, w) for v, w in published.items()}
    resumed = flips = fed = 0
    lp_err_same, lp_err_older = [], []
    for batch in trained:
        for ids, routes, rollout_lp, versions, p_len in _rows(batch):
            newest = int(versions.max())
            resumed += int(versions.min()) != newest
            model, ctl = models[newest]
            S, (L, k) = len(ids), routes.shape[1:]
            record = torch.zeros(1, S, L, k, dtype=torch.int64)
            ctl.record(_target(record, S))
            with torch.no_grad():
                model(ids[None])
            ctl.record(None)
            own = record[0, : S - 1].sort(-1).values
            flips += int((own != routes.long().sort(-1).values).any(-1).sum())
            fed += (S - 1) * L
            replay = torch.cat([routes, torch.arange(k, dtype=routes.dtype).expand(1, L, k)])  # + the last token
            ctl.replay(replay.long())
            with torch.no_grad():
                logits = model(ids[None]).logits[0].float()
            ctl.replay(None)
            lp = torch.log_softmax(logits[p_len - 1 : S - 1], -1).gather(-1, ids[p_len:, None])[:, 0]
            err = (lp - rollout_lp).abs()
            lp_err_same.append(err[versions == newest].max())
            if (versions != newest).any():
                lp_err_older.append(err[versions != newest].max())
    assert resumed > 0, "no trained sample spans a weight update"
    assert flips / fed <= 0.002, f"{flips} of {fed} fed (token, layer) routes differ from the newest weights' routing"
    assert max(lp_err_same) < 1e-4, max(lp_err_same)  # same weights, replayed routes: the rollout's log-probs
    assert max(lp_err_older) > 1e-3  # older tokens: another policy (off-policy, corrected by the trainer)


def _target(routes: torch.Tensor, S: int):
    from lumenrl_moe import RecordTarget

    return RecordTarget(routes=routes, index=(torch.zeros(S, dtype=torch.long), torch.arange(S)))
