"""The async rollouter on the native engine (tiny Qwen3, CPU): interrupted-and-resumed sequences
equal uninterrupted ones when weights do not change; across a weight update each token records
the policy version that generated it; groups reach the sink whole; the budget is respected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lumenrl_async import StalenessConfig, StalenessController
from lumenrl_backends.engines import NativeEngine
from lumenrl_backends.models import load_model_and_tokenizer
from lumenrl_backends.trainers.rollouter import Rollouter, RolloutHooks
from lumenrl_core.assembly.requirements import moe_layout_supported
from lumenrl_core.data_proto import DataProto

pytestmark = pytest.mark.usefixtures("one_thread")  # the root conftest.py: small tensors, a shared CPU
PROMPTS = ["12+34=", "7*8=", "9-3=", "5+5=", "1*1=", "8+0="]
N = 2


def _engine(qwen3_dir, **kwargs) -> NativeEngine:
    model, tokenizer = load_model_and_tokenizer(str(qwen3_dir), dtype="float32")
    return NativeEngine(model, tokenizer, max_batch_size=16, max_seq_len=64, **kwargs)


class _Prompts:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.i = tokenizer, 0

    def __call__(self) -> DataProto:
        texts = [PROMPTS[(self.i + j) % len(PROMPTS)] for j in range(2)]
        self.i += 2
        enc = self.tokenizer(texts, padding=True, return_tensors="pt")
        return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
                                   {"raw_prompt": texts})


def _rollouter(engine, groups: list, *, budget_samples: int, new_weights=None, staleness: float = 0.0) -> Rollouter:
    state = {"version": 0, "outstanding": 0, "stale": 0}  # the trainer's side of the queue, set by a test

    def load(eng):
        if new_weights is None:
            return state["version"]  # the weights are unchanged; the version is what was published
        if state["version"] == 1 and eng.weight_version == 0:
            eng.update_weights(new_weights, 1)
        return eng.weight_version

    hooks = RolloutHooks(sink=groups.append, ledger=lambda: (state["outstanding"], state["stale"]),
                         newest_version=lambda: state["version"], load_weights=load)
    ctl = StalenessController(StalenessConfig(staleness_threshold=staleness, mini_batch_size=budget_samples))
    r = Rollouter(engine=engine, next_prompts=_Prompts(engine.tokenizer), n=N, run_seed=3, budget=ctl, hooks=hooks,
                  sampling={"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}, partial_rollout=True,
                  max_rows=8)
    r._state = state
    return r


def _interrupt_after(engine, decode_steps: int):
    """Make the engine's next generate call stop after ``decode_steps`` decode steps."""
    original, count = engine._decode, [0]

    def decode(*args, **kwargs):
        count[0] += 1
        if count[0] == decode_steps:
            engine.interrupt()
        return original(*args, **kwargs)

    engine._decode = decode
    return lambda: setattr(engine, "_decode", original)


def _by_uid(groups) -> dict:
    out = {}
    for g in groups:
        for row in range(len(g.payload)):
            out[(g.uid, row)] = g.payload[row : row + 1]
    return out


def test_interrupted_and_resumed_rows_equal_uninterrupted_ones(qwen3_dir):
    plain, cut = [], []
    a = _rollouter(_engine(qwen3_dir), plain, budget_samples=12)
    a.max_rows = 12
    while len(plain) < 6:
        assert a.step()
    b_engine = _engine(qwen3_dir)
    b = _rollouter(b_engine, cut, budget_samples=12)
    b.max_rows = 4
    restore = _interrupt_after(b_engine, 4)
    assert b.step()  # interrupted: nothing finished (ignore_eos, 12 tokens), all rows left over
    restore()
    assert not cut and b._leftover is not None and len(b._leftover) == 4
    b.max_rows = 12
    while len(cut) < 6:  # the leftover continues together with 8 fresh rows in one call
        assert b.step()
    assert b_engine.kept_slots["reclaimed"] == 4  # in the slots it kept: its caches reused, not prefilled again
    x, y = _by_uid(plain), _by_uid(cut)
    assert x.keys() == y.keys()
    for key in x:
        for name in ("responses", "response_mask"):
            assert torch.equal(y[key].batch[name], x[key].batch[name]), key
        # log-probs: the same up to fp32 reduction order (prefill batches are shaped differently)
        torch.testing.assert_close(y[key].batch["rollout_log_probs"], x[key].batch["rollout_log_probs"],
                                   rtol=0, atol=2e-5, msg=str(key))
        assert int(y[key].batch["token_versions"].max()) == 0
    assert all(g.size == N for g in cut) and a.stats["partial_rollouts"] == b.stats["partial_rollouts"] == 0


def test_a_sequence_spanning_a_weight_update_records_per_token_versions(qwen3_dir):
    engine = _engine(qwen3_dir)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()
                 if v.is_floating_point()}
    groups: list = []
    r = _rollouter(engine, groups, budget_samples=4, new_weights=perturbed)
    restore = _interrupt_after(engine, 5)
    assert r.step() and not groups
    restore()
    r._state["version"] = 1  # a sync: the leftover resumes under version 1, with a new window's fresh rows
    assert r.step()
    assert engine.weight_version == 1
    partial = [g for g in groups if g.uid.startswith("s1r0")]
    fresh = [g for g in groups if not g.uid.startswith("s1r0")]
    assert len(partial) == 2 and len(fresh) == 2
    for g in partial:
        tv, mask = g.payload.batch["token_versions"], g.payload.batch["response_mask"].bool()
        assert g.versions == (0,) * N and g.newest_version == 1
        for row in range(len(g.payload)):
            seq = tv[row][mask[row]].tolist()
            assert seq[0] == 0 and seq[-1] == 1 and seq == sorted(seq)  # old tokens first, then new
    for g in fresh:
        assert g.versions == (1,) * N and g.newest_version == 1
    assert r.stats["partial_rollouts"] == 4
    # each window's budget (4 samples) was honoured: no group started after it ran out
    assert not r.step() and sum(g.size for g in groups) == 8


def test_stale_drops_after_a_window_starts_are_replaced_exactly(qwen3_dir):
    """A window starts with the queue full of stale samples (budget 0); the trainer then drops
    them as too old. The rollouter must replace exactly those (else trainer and rollouter wait on
    each other forever), and drops seen while a newer version waits are left to that window."""
    groups: list = []
    r = _rollouter(_engine(qwen3_dir), groups, budget_samples=4, staleness=1.0)  # window capacity 8
    r._state.update(version=1, outstanding=8)
    assert not r.step() and not groups  # all 8 queued samples charged as stale: nothing may start
    r._state.update(outstanding=2, stale=6)  # the trainer took them: 6 dropped as stale, 2 consumed
    while r.step():
        pass
    assert sum(g.size for g in groups) == 6 and r.stats["budget_refunds"] == 6
    r._state.update(version=2, stale=10)  # a newer version is published but not loaded yet...
    r._refund_stale_drops()
    assert r.budget.refunded == 6  # ...its drops are not refunded to the old window
    r._state.update(outstanding=4)
    assert r.step() and r.window_version == 2  # the new window charges only the 4 still outstanding
    while r.step():
        pass
    assert sum(g.size for g in groups) == 6 + 4 and r.stats["budget_refunds"] == 6


def test_a_load_that_brings_nothing_newer_keeps_the_window(qwen3_dir):
    """A sync is announced but the weights loaded are still the window's version: the window and its
    spent budget go on (restarting it would grant a fresh budget at every step, without end)."""
    groups: list = []
    r = _rollouter(_engine(qwen3_dir), groups, budget_samples=4)  # on-policy: 4 samples per window
    while r.step():
        pass
    assert sum(g.size for g in groups) == 4 and r.window_version == 0
    r.hooks.load_weights = lambda engine: 0
    r._state["version"] = 1
    assert not r.step() and r.window_version == 0 and sum(g.size for g in groups) == 4


def _uneven_lengths(r: Rollouter) -> None:
    """Rows of one group get different lengths (3 and 12 tokens): a group can be half finished."""
    original = r._next_round

    def next_round():
        rows = original()
        rows["max_new_tokens"] = np.array([12 if i % 2 else 3 for i in range(len(rows))], dtype=np.int64)
        return rows

    r._next_round = next_round


def _fed_routes(group) -> dict:
    """uid/row -> routes (S - 1, L, k) of the positions fed to the model (prompt + response but the last)."""
    out, batch = {}, group.payload.batch
    P = batch["prompts"].shape[1]
    for row in range(len(group.payload)):
        lo = P - int(batch["attention_mask"][row, :P].sum())
        fed = P - lo + int(batch["response_mask"][row].sum()) - 1
        out[(group.uid, row)] = batch["routed_experts"][row, lo : lo + fed]
    return out


@pytest.mark.skipif(not moe_layout_supported(), reason="R3 needs the transformers >= 5.13 MoE layout")
def test_r3_routes_of_a_half_finished_group_survive_an_interrupt(tiny_model_dir):
    """R3 on: a group interrupted with one row finished (3 tokens) and one running (12) continues
    together with fresh rows; the finished row keeps its routes, the running row is re-prefilled:
    every row's routes equal an uninterrupted run's (weights unchanged)."""
    moe_dir = tiny_model_dir("qwen3_moe", initializer_range=0.2)
    plain, cut = [], []
    a = _rollouter(_engine(moe_dir, record_routes=True), plain, budget_samples=12)
    _uneven_lengths(a)
    a.max_rows = 12
    while len(plain) < 6:
        assert a.step()
    b_engine = _engine(moe_dir, record_routes=True)
    b = _rollouter(b_engine, cut, budget_samples=12)
    _uneven_lengths(b)
    b.max_rows = 4
    restore = _interrupt_after(b_engine, 6)
    assert b.step() and not cut  # interrupted: each group has its 3-token row done, its 12-token row not
    restore()
    left = b._leftover.non_tensor_batch["finish_reason"].tolist()
    assert left.count("length") == 2 and left.count("interrupted") == 2
    b.max_rows = 12
    while len(cut) < 6:  # the half-finished groups continue together with fresh rows
        assert b.step()
    x = {k: v for g in plain for k, v in _fed_routes(g).items()}
    y = {k: v for g in cut for k, v in _fed_routes(g).items()}
    assert x.keys() == y.keys()
    for key in x:
        assert torch.equal(y[key], x[key]), key


@pytest.mark.parametrize("overrides,elsewhere", [
    (("weight_sync.method=filesystem", "eval.enabled=false"), True),  # a rollouter process, nothing else generates
    (("weight_sync.method=cuda_ipc", "eval.enabled=false"), True),
    (("weight_sync.method=filesystem", "eval.enabled=true"), False),  # eval runs on this process's engine
    (("weight_sync.method=inprocess", "eval.enabled=false"), False),  # the rollouter thread uses this engine
])
def test_the_trainer_process_builds_an_engine_only_when_it_generates(overrides, elsewhere):
    from pathlib import Path

    from lumenrl_backends.trainers.placement import rollout_elsewhere
    from lumenrl_core.config import load_config

    preset = Path(__file__).resolve().parents[3] / "configs" / "grpo_async_partial.yaml"
    assert rollout_elsewhere(load_config(preset, list(overrides))) is elsewhere
    sync_preset = preset.with_name("grpo_dense_bf16.yaml")
    assert rollout_elsewhere(load_config(sync_preset, ["eval.enabled=false"])) is False
