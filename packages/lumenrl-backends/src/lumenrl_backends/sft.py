"""Warm start for the embedded demo: a short supervised fine-tune before RL, cached on disk.

A freshly initialised tiny model never produces a correct answer, so RL would have no reward
signal. ``trainer.warm_start_sft_steps`` > 0 first fine-tunes the policy on the task's reference
answers (prompt rendered exactly as the RL dataloader renders it, target = answer + EOS, loss on
the target tokens only) with the training backend's ``sft_step``, to a partial accuracy that RL
then raises. The result is an ordinary HF checkpoint under
``$LUMENRL_CACHE/warmstart/<model>-<key>``, where ``key`` hashes everything that determines it:
the base model's config, dataset, prompt rendering, steps, lr, batch size, the training
backend class, the source of ``lumenrl_backends`` and ``lumenrl_core`` (the data pipeline,
the backend's ``sft_step``, this module) and the torch / transformers versions. A repeated run
or test reuses it instead of training again; a code change trains anew. An entry that fails
its checks (manifest key, config, weight files: :mod:`lumenrl_backends.models.cache`) is
rebuilt. Written to a temporary directory and renamed into place, so a concurrent or crashed
build never leaves a partial checkpoint; staging directories of a crashed build are removed.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lumenrl_backends
import lumenrl_core
from lumenrl_backends.models import cache, model_cache_dir
from lumenrl_backends.trainers.data import TASK_SEED, make_loader, split_records
from lumenrl_backends.training import distributed as dist_utils
from lumenrl_core.data_proto import DataProto

__all__ = ["warm_start_key", "warm_start_dir", "sft_batch", "target_text", "warm_start"]

_SFT_SEED = 0  # data order of the warm start: fixed, so every run seed shares one cached model


def target_text(record: dict[str, Any]) -> str:
    """What the SFT teaches for ``record``: a reference solution if the task has one, else the answer."""
    extra = record.get("extra") or {}
    if "solution" in extra:
        return str(extra["solution"])
    return str(record["ground_truth"])


def warm_start_key(cfg: Any, base_path: str, backend_cls: type | None = None) -> str:
    """Hash of everything that determines the warm-started weights."""
    config_file = Path(base_path) / "config.json"
    ds, t = cfg.dataset, cfg.trainer
    material = {
        "base": config_file.read_text() if config_file.is_file() else base_path,
        "dataset": [
            ds.name,
            ds.path,
            ds.difficulty,
            ds.num_examples,
            ds.prompt_template,
            ds.use_chat_template,
        ],
        "max_prompt_length": cfg.policy.max_prompt_length,
        "sft": [
            t.warm_start_sft_steps,
            t.warm_start_sft_lr,
            t.warm_start_sft_batch_size,
            TASK_SEED,
            _SFT_SEED,
        ],
        "micro_batch_size": cfg.policy.train.micro_batch_size,
        "backend": f"{backend_cls.__module__}.{backend_cls.__qualname__}" if backend_cls else "",
    }
    return cache.artifact_key(material, [lumenrl_backends, lumenrl_core])


def warm_start_dir(cfg: Any, base_path: str, backend_cls: type | None = None) -> Path:
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in cfg.policy.model_name)
    return model_cache_dir() / "warmstart" / f"{slug}-{warm_start_key(cfg, base_path, backend_cls)}"


def sft_batch(prompts: DataProto, records: list[dict[str, Any]], tokenizer: Any) -> DataProto:
    """Left-padded prompt ++ right-padded (target + EOS); ``labels`` = -100 except on the target."""
    eos = tokenizer.eos_token_id
    targets = [list(tokenizer.encode(target_text(r), add_special_tokens=False)) + [eos] for r in records]
    width = max(len(t) for t in targets)
    rows, prompt_width = len(targets), prompts.batch["input_ids"].shape[1]
    response = torch.full((rows, width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    for i, ids in enumerate(targets):
        response[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = 1
    input_ids = torch.cat([prompts.batch["input_ids"], response], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompts.batch["attention_mask"], response_mask], dim=1)
    labels = torch.full_like(input_ids, -100)
    labels[:, prompt_width:] = torch.where(response_mask.bool(), response, torch.full_like(response, -100))
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})


def _train(cfg: Any, base_path: str, backend_cls: type, out: Path, log: Callable[[str], None]) -> None:
    from transformers import AutoTokenizer

    t = cfg.trainer
    tokenizer = AutoTokenizer.from_pretrained(base_path, local_files_only=Path(base_path).is_dir())
    records, _ = split_records(cfg)
    loader = make_loader(
        cfg, records, tokenizer, batch_size=t.warm_start_sft_batch_size, seed=_SFT_SEED, shuffle=True
    )
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.quantization.training.precision = "bf16"  # plain fine-tune: no FP8 training recipe here
    backend = backend_cls.from_config(sft_cfg, role="actor", model_path=base_path)
    start, every = time.perf_counter(), max(t.warm_start_sft_steps // 5, 1)
    for step in range(1, t.warm_start_sft_steps + 1):
        prompts = loader.next_batch()
        batch = sft_batch(
            prompts, [loader.records[int(i)] for i in prompts.non_tensor_batch["index"]], tokenizer
        )
        metrics = backend.sft_step(batch, lr=t.warm_start_sft_lr)
        if step % every == 0 or step == t.warm_start_sft_steps:
            log(
                f"warm-start SFT step {step}/{t.warm_start_sft_steps}: loss {metrics['sft/loss']:.4f} "
                f"({time.perf_counter() - start:.0f}s)"
            )
    backend.save_hf(str(out), tokenizer=tokenizer)


def warm_start(cfg: Any, base_path: str, backend_cls: type, log: Callable[[str], None] = print) -> str:
    """Path of the warm-started policy for ``cfg`` (trained now unless cached)."""
    target = warm_start_dir(cfg, base_path, backend_cls)
    key = target.name.rsplit("-", 1)[1]
    if cache.entry_is_valid(target, key):
        log(f"warm start: reusing cached SFT checkpoint {target}")
        return str(target)
    if dist_utils.world_size() > 1:
        return _warm_start_ranks(cfg, base_path, backend_cls, target, key, log)
    steps = cfg.trainer.warm_start_sft_steps
    log(f"warm start: {steps} SFT steps on {cfg.dataset.name} (cached at {target})")
    cache.build_entry(target, key, lambda staging: _train(cfg, base_path, backend_cls, staging, log))
    return str(target)


def _warm_start_ranks(
    cfg: Any, base_path: str, backend_cls: type, target: Path, key: str, log: Callable[[str], None]
) -> str:
    """Under torchrun: all ranks train (the SFT step is collective); rank 0 writes and publishes."""
    staging = target.parent / f".{target.name}.{os.getpid()}.staging"
    if dist_utils.rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        cache.clean_stale_staging(target.parent, target.name)
        staging.mkdir(parents=True)
    dist_utils.barrier()
    _train(cfg, base_path, backend_cls, staging, log)  # save_hf: rank 0 writes, then a barrier
    if dist_utils.rank() == 0:
        cache.build_entry(target, key, lambda out: _move_contents(staging, out))
        shutil.rmtree(staging, ignore_errors=True)
    dist_utils.barrier()
    return str(target)


def _move_contents(src: Path, dst: Path) -> None:
    for item in src.iterdir():
        shutil.move(str(item), dst / item.name)
