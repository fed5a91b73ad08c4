"""The SDDD teacher side: load (and for the demo, first train) the teacher, regenerate the corpus
prompts with the native engine, capture hidden states through it, and publish them on a transfer
engine; in-process (online mode) or as its own process (disaggregated mode).

Keys published: ``counts`` (token frequencies of the regenerated data, for the Eagle3 draft
vocabulary: ``{"counts": (V,)}``) and ``chunk/<i>`` (captures of ``sddd.batch_size`` sequences:
``input_ids``, ``attention_mask``, ``hidden``, ``logits``), ``meta`` (``{"chunks": (1,)}``).
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch

from lumenrl_backends.engines.native import NativeEngine
from lumenrl_backends.engines.speculative import capture_hidden
from lumenrl_backends.models import load_model_and_tokenizer, resolve_model_path
from lumenrl_core.data_proto import DataProto
from lumenrl_sddd.capture import dflash_layer_ids, eagle3_layer_ids
from lumenrl_sddd.corpus import corpus_lines, encode_lines, prompts_from_lines, train_causal_lm
from lumenrl_sddd.vocab import token_counts

__all__ = ["load_teacher", "aux_layer_ids", "publish", "teacher_process", "corpus_prompts", "prompt_batch"]


def load_teacher(cfg: Any, path: str | None = None) -> tuple[Any, Any]:
    """The policy model as teacher (``policy.model_name``, its tokenizer ``policy.tokenizer_name`` or the model's,
    ``policy.dtype``, ``policy.trust_remote_code``), loaded as the RL path loads its policy;
    ``sddd.teacher_train_steps`` > 0 first trains it on the corpus.

    ``path``: the teacher the trainer process saved (disaggregated mode's teacher process), model and tokenizer
    both from there (the tokenizer saved is the one ``policy.tokenizer_name`` named), not trained again."""
    policy = cfg.policy
    model, tokenizer = load_model_and_tokenizer(
        path or resolve_model_path(policy.model_name), dtype=policy.dtype,
        tokenizer_name="" if path else policy.tokenizer_name, trust_remote_code=policy.trust_remote_code)
    if path is None and cfg.sddd.teacher_train_steps:
        ids = encode_lines(tokenizer, corpus_lines(2048, seed=cfg.seed), 64)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            train_causal_lm(model, ids, pad_id=tokenizer.pad_token_id, steps=cfg.sddd.teacher_train_steps,
                            batch_size=16, seed=cfg.seed)
    return model.eval(), tokenizer


def aux_layer_ids(cfg: Any, num_layers: int) -> list[int]:
    if cfg.sddd.draft == "dflash":
        return dflash_layer_ids(num_layers, cfg.sddd.num_aux_layers)
    return eagle3_layer_ids(num_layers)


def corpus_prompts(cfg: Any, tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    return prompts_from_lines(tokenizer, corpus_lines(count, seed=seed), cfg.sddd.prompt_tokens)


def prompt_batch(prompts: list[list[int]], pad_id: int) -> DataProto:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})


def publish(cfg: Any, engine: NativeEngine, tokenizer: Any, transfer: Any, layer_ids: list[int]) -> int:
    """Regenerate ``sddd.num_prompts`` corpus prompts with the teacher and publish the captures; returns chunks."""
    s = cfg.sddd
    prompts = corpus_prompts(cfg, tokenizer, s.num_prompts, seed=cfg.seed + 1)
    sampling = {"temperature": s.teacher_temperature, "max_new_tokens": s.response_tokens,
                "ignore_eos": True, "seed": cfg.seed}
    out = engine.generate(prompt_batch(prompts, tokenizer.pad_token_id), sampling)
    ids, mask = out.batch["input_ids"], out.batch["attention_mask"]
    transfer.put("counts", {"counts": token_counts(ids, mask, engine.model.config.vocab_size)})
    chunks = 0
    for start in range(0, ids.shape[0], s.batch_size):
        capture = capture_hidden(engine, ids[start:start + s.batch_size], mask[start:start + s.batch_size], layer_ids)
        transfer.put(f"chunk/{chunks}", capture)
        chunks += 1
    transfer.put("meta", {"chunks": torch.tensor([chunks])})
    return chunks


def teacher_engine(cfg: Any, model: Any, tokenizer: Any) -> NativeEngine:
    return NativeEngine.from_config(cfg, model, tokenizer)


def teacher_process(cfg: Any, teacher_dir: str, transfer_name: str, channel: Any, stop: Any) -> None:
    """Disaggregated mode: the teacher in its own process; publishes, reports, serves until ``stop``.

    ``cfg``: the trainer's RunConfig itself (pickled), not rebuilt from a dict: a rebuild is one config layer, so
    it would refuse a setting the trainer's layered load accepted (a base file's key its override switched off)."""
    from lumenrl_core.plugins import get_registry

    torch.set_num_threads(1)
    try:
        model, tokenizer = load_teacher(cfg, teacher_dir)
        engine = teacher_engine(cfg, model, tokenizer)
        transfer = get_registry().load("transfer_engines", transfer_name).from_config(cfg)
        chunks = publish(cfg, engine, tokenizer, transfer, aux_layer_ids(cfg, model.config.num_hidden_layers))
        channel.put(("ready", chunks, getattr(transfer, "address", None)))
    except Exception as exc:  # noqa: BLE001 - reported to the trainer process, which raises it
        channel.put(("error", f"{type(exc).__name__}: {exc}", None))
        return
    stop.wait(600)  # producers that serve (tcp, mooncake) must outlive the reads
    if transfer_name != "shm":
        transfer.close()


def start_teacher_process(cfg: Any, teacher_dir: Path, transfer_name: str) -> tuple[Any, Any, Any]:
    ctx = mp.get_context("spawn")
    channel, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=teacher_process, args=(cfg, str(teacher_dir), transfer_name, channel, stop), daemon=True)
    proc.start()
    return proc, channel, stop
