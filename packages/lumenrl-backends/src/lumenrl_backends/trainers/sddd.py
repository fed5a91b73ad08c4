"""``SDDDTrainer`` (``algorithm.name: sddd``, ``trainer.name: sddd``): speculative-decoding draft distillation.

One run::

    teacher (policy model; demo: first trained on lumenrl-sddd's structured corpus)
      -> native engine regenerates sddd.num_prompts corpus prompts, captures hidden states + logits
      -> transfer engine (online: in-process teacher; disaggregated: teacher process -> shm/tcp/mooncake)
      -> draft steps (Eagle3 training-time test, or DFlash anchored blocks) over the chunks, cycling
      -> tau (accepted tokens per verify, real speculative decoding in the native engine) before/after

Reuses the RL trainer's phase modules: checkpoints (:mod:`.checkpoint`: draft + optimizer as the
``draft`` role, resume), metrics/timing (:mod:`.metrics`), run record and summary (:mod:`.outputs`),
loggers (``logger.backends``). ``final/`` holds the draft (Eagle3: the vLLM/SGLang layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.engines.speculative import attach_draft
from lumenrl_backends.trainers.build import seed_everything, set_host_threads
from lumenrl_backends.trainers.checkpoint import CheckpointManager
from lumenrl_backends.trainers.metrics import PhaseTimer
from lumenrl_backends.trainers.outputs import write_run_record, write_summary
from lumenrl_backends.trainers.sddd_teacher import (
    aux_layer_ids,
    corpus_prompts,
    load_teacher,
    prompt_batch,
    publish,
    start_teacher_process,
    teacher_engine,
)
from lumenrl_core.plugins import get_registry
from lumenrl_sddd.export import save_draft

__all__ = ["SDDDTrainer", "build_draft", "measure_tau", "draft_loss"]


def build_draft(cfg: Any, teacher: Any, counts: torch.Tensor) -> Any:
    """The ``sddd.draft`` plugin (``lumenrl.draft_models``) initialised from the teacher."""
    s = cfg.sddd
    cls = get_registry().load("draft_models", s.draft)
    layers = aux_layer_ids(cfg, teacher.config.num_hidden_layers)
    if s.draft == "eagle3":
        vocab = s.draft_vocab_size or teacher.config.vocab_size
        return cls.from_teacher(teacher, counts=counts, draft_vocab_size=min(vocab, teacher.config.vocab_size),
                                aux_layer_ids=layers, ttt_steps=s.ttt_steps)
    return cls.from_teacher(teacher, aux_layer_ids=layers, num_layers=s.dflash_layers, block_size=s.block_size,
                            gamma=s.gamma)


def draft_tokens(cfg: Any) -> int:
    return cfg.sddd.block_size - 1 if cfg.sddd.draft == "dflash" else cfg.sddd.num_draft_tokens


def draft_loss(draft: Any, batch: dict[str, torch.Tensor], generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    if draft.kind == "eagle3":
        return draft.ttt_loss(batch)
    return draft.block_loss(batch, generator=generator)


@torch.no_grad()
def measure_tau(engine: Any, draft: Any, prompts: list[list[int]], *, k: int, max_new_tokens: int, pad_id: int) -> float:
    """Acceptance length of real greedy speculative decoding on ``prompts`` (draft left attached: no)."""
    was_training = draft.training
    attach_draft(engine, draft, k)
    try:
        out = engine.generate(prompt_batch(prompts, pad_id), {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                              "ignore_eos": True})
    finally:
        attach_draft(engine, None, 0)
        draft.float().train(was_training)
    return float(out.meta_info["speculative"]["tau"])


def _checkpoint_due(ckpt: Any, step: int, last: int) -> bool:
    """The RL loop's rule (``loop._due``; importing it here would be circular): none while
    ``checkpointing.enabled`` is false, else every ``save_every`` steps and the last step (``save_every: 0``:
    the last step only)."""
    if not ckpt.enabled:
        return False
    return step == last or (ckpt.save_every > 0 and step % ckpt.save_every == 0)


class _DraftCheckpoint:
    """The draft and its optimizer as a checkpoint role (CheckpointManager's backend interface)."""

    def __init__(self, draft: Any, optimizer: Any) -> None:
        self.draft, self.optimizer = draft, optimizer

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save({"draft": self.draft.state_dict(), "optimizer": self.optimizer.state_dict()}, Path(path) / "draft.pt")

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(Path(path) / "draft.pt", weights_only=True)
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])


class SDDDTrainer:
    """The ``sddd`` trainer plugin: ``SDDDTrainer.from_plan(plan).fit()``."""

    capabilities = manifest.SDDD.capabilities

    def __init__(self, plan: Any) -> None:
        cfg = self.config = plan.config
        if cfg.algorithm.name != "sddd":
            raise ValueError(f"trainer.name='sddd' needs algorithm.name='sddd' (got {cfg.algorithm.name!r})")
        self.plan, self.out = plan, Path(cfg.trainer.output_dir)
        seed_everything(cfg.seed)
        set_host_threads(cfg.trainer.cpu_threads)
        self.teacher, self.tokenizer = load_teacher(cfg)
        self.engine = teacher_engine(cfg, self.teacher, self.tokenizer)
        set_host_threads(cfg.trainer.cpu_threads, next(self.teacher.parameters()).device)
        self.transfer, self._proc, self._stop = self._open_transfer()
        meta = self.transfer.get("meta")
        self.chunks = int(meta["chunks"][0])
        self.draft = build_draft(cfg, self.teacher, self.transfer.get("counts")["counts"])
        params = [p for p in self.draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.sddd.lr, weight_decay=0.0)
        self.checkpoints = CheckpointManager(root=self.out / "checkpoints", keep_last=cfg.checkpointing.keep_last)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.loggers: list[Any] = []  # built in fit(), after the run directory is checked and a resume point known
        self.step = 0

    @classmethod
    def from_plan(cls, plan: Any) -> SDDDTrainer:
        return cls(plan)

    @classmethod
    def probe(cls) -> str | None:
        return manifest.SDDD.unavailable_reason()

    # ------------------------------------------------------------------ teacher -> transfer engine
    def _open_transfer(self) -> tuple[Any, Any, Any]:
        cfg, s = self.config, self.config.sddd
        registry = get_registry()
        if s.mode == "online":
            transfer = registry.load("transfer_engines", s.transfer_engine).from_config(cfg)
            publish(cfg, self.engine, self.tokenizer, transfer, aux_layer_ids(cfg, self.teacher.config.num_hidden_layers))
            return transfer, None, None
        teacher_dir = self.out / "teacher"
        self.teacher.save_pretrained(teacher_dir)
        self.tokenizer.save_pretrained(teacher_dir)
        proc, channel, stop = start_teacher_process(cfg, teacher_dir, s.transfer_engine)
        status, payload, address = channel.get(timeout=600)
        if status != "ready":
            raise RuntimeError(f"SDDD teacher process failed: {payload}")
        cls = registry.load("transfer_engines", s.transfer_engine)
        transfer = cls(connect=tuple(address)) if s.transfer_engine == "tcp" else cls.from_config(cfg)
        return transfer, proc, stop

    # ------------------------------------------------------------------ loop
    def _tau(self) -> float:
        s = self.config.sddd
        prompts = corpus_prompts(self.config, self.tokenizer, s.eval_prompts, seed=self.config.seed + 7)
        return measure_tau(self.engine, self.draft, prompts, k=draft_tokens(self.config),
                           max_new_tokens=s.response_tokens, pad_id=self.tokenizer.pad_token_id)

    def train_step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer()
        with timer("transfer"):
            batch = self.transfer.get(f"chunk/{(step - 1) % self.chunks}")
        with timer("update_draft"):
            loss, metrics = draft_loss(self.draft, batch, self.generator)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
            self.optimizer.step()
        return {"sddd/loss": float(loss.detach()), "sddd/grad_norm": float(grad), **metrics, **timer.metrics(),
                "perf/step_s": timer.elapsed()}

    def _resume(self) -> None:
        latest = self.checkpoints.latest() if self.config.checkpointing.resume else None
        if latest is not None:
            state, _ = CheckpointManager.load(latest, backends={"draft": _DraftCheckpoint(self.draft, self.optimizer)})
            self.step = int(state["step"])

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        write_run_record(self.out, cfg, {"trainer": "sddd", "plugins": dict(self.plan.plugin_names)})
        self._resume()
        resume_step = self.step if self.step > 0 else None  # jsonl drops records after the resumed step
        self.loggers = [cls.from_config(cfg, resume_step=resume_step) if name == "jsonl" else cls.from_config(cfg)
                        for name, cls in self.plan.logger_classes.items()]
        tau_before = self._tau()
        history: dict[str, list[float]] = {}
        try:
            for step in range(self.step + 1, cfg.num_training_steps + 1):
                metrics = self.train_step(step)
                if cfg.eval.every and step % cfg.eval.every == 0:
                    metrics["sddd/tau"] = self._tau()
                for key, value in metrics.items():
                    history.setdefault(key, []).append(value)
                for logger in self.loggers:
                    logger.log(metrics, step)
                self.step = step
                if _checkpoint_due(cfg.checkpointing, step, cfg.num_training_steps):
                    self.checkpoints.save(step, backends={"draft": _DraftCheckpoint(self.draft, self.optimizer)},
                                          dataloader_state={}, trainer_state={"chunks": self.chunks})
            tau_after = self._tau()
            save_draft(self.draft, self.out / "final")
            summary = {"trainer": "sddd", "draft": self.draft.kind, "mode": cfg.sddd.mode,
                       "transfer_engine": cfg.sddd.transfer_engine, "steps": self.step,
                       "tau_before": tau_before, "tau_after": tau_after, "draft_tokens": draft_tokens(cfg),
                       "loss_first": history.get("sddd/loss", [float("nan")])[0],
                       "loss_last": history.get("sddd/loss", [float("nan")])[-1]}
            write_summary(self.out, summary)
            return summary
        finally:
            self.close()

    def close(self) -> None:
        for logger in self.loggers:
            getattr(logger, "close", lambda: None)()
        if self._stop is not None:
            self._stop.set()
            self._proc.join(timeout=30)
        self.transfer.close()
