"""Adapters for external inference libraries: vLLM, SGLang and AMD's ATOM.

UNTESTED HERE: none of these libraries is installed in LumenRL's CI (they need GPUs and their own
torch builds). Each adapter is deliberately small: ``probe()`` says why it cannot run
(library missing, a namesake package, API not found), and ``generate`` translates to the
library's public offline API and returns the same rollout layout as ``native``. Known gaps:

* log-probs: vLLM returns ``processed_logprobs`` (after temperature, AND after top-k/top-p
  masking, which differs from LumenRL's convention only when top-k/top-p are active); SGLang
  returns its own per-token log-probs; ATOM's offline API returns none, so its
  ``rollout_log_probs`` are NaN and it lacks the ``logprobs`` capability.
* interrupt/resume is not offered (no ``interrupt_resume`` capability); the methods raise.
* weight updates use each library's public hook (vLLM ``LLM.apply_model`` +
  ``load_weights``, SGLang ``Engine.update_weights_from_tensor``); ATOM has none.

Keys passed to the library (``from_config``): the model and tokenizer (``policy.model_name``,
``policy.tokenizer_name``, empty = the model's), ``policy.trust_remote_code``,
``policy.rollout.max_batch_size`` (vLLM/ATOM ``max_num_seqs``, SGLang ``max_running_requests``),
``policy.rollout.gpu_memory_utilization`` (vLLM/ATOM ``gpu_memory_utilization``, SGLang
``mem_fraction_static``), ``policy.rollout.tensor_parallel_size`` (vLLM/SGLang) and ``policy.dtype`` (vLLM/SGLang
``dtype``, the same names, ``auto`` included). ATOM's ``Config`` has no dtype argument (its dtype is the
checkpoint's) and its ``SamplingParams`` no ``stop_token_ids``: its responses are cut after the first stop
token here (the tokens before it are the ones a stopping engine would have produced).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.engines.requests import LENGTH, STOP, Request, build_rollout_batch, requests_from_batch
from lumenrl_backends.engines.sampling import SamplingParams, coerce_sampling
from lumenrl_backends.plugin_manifest import probe_module

__all__ = ["VLLMEngine", "SGLangEngine", "AtomEngine", "probe_module"]


def _finish(request: Request, tokens: list[int], log_probs: list[float], reason: str | None) -> None:
    request.response, request.log_probs = list(tokens), list(log_probs)
    request.finish_reason = STOP if reason in ("stop", "eos", "abort_stop") else LENGTH


def _rollout(
    batch: Any,
    params: SamplingParams,
    outputs: list[tuple[list[int], list[float], str | None]],
    tokenizer: Any,
    pad_id: int,
    version: int,
) -> Any:
    requests, prompts, prompt_mask = requests_from_batch(batch, params)
    for request, (tokens, log_probs, reason) in zip(requests, outputs, strict=True):  # one reply per row
        _finish(request, tokens, log_probs, reason)
    meta = {"interrupted": False, "weight_version": version, "temperature": float(params.temperature)}
    return build_rollout_batch(
        requests,
        prompts,
        prompt_mask,
        width=params.max_new_tokens,
        pad_id=pad_id,
        tokenizer=tokenizer,
        meta_info=meta,
    )


def _top_k(params: SamplingParams) -> int:
    """LumenRL's top_k <= 0 (disabled) as the libraries' -1 (their "disabled"; ATOM and older vLLM refuse 0)."""
    return params.top_k if params.top_k > 0 else -1


def _prompt_ids(batch: Any) -> list[list[int]]:
    ids, mask = batch.batch["input_ids"].cpu(), batch.batch["attention_mask"].cpu()
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def _weight_list(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    return list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)


class _NoInterrupt:
    def interrupt(self) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} does not support interrupt/resume; use rollout_engine=native"
        )

    def resume(self) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} does not support interrupt/resume; use rollout_engine=native"
        )


def _load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _model_and_tokenizer_paths(policy: Any) -> tuple[str, str]:
    """``policy.model_name`` and ``policy.tokenizer_name`` (empty: the model's) as local paths or hub ids."""
    from lumenrl_backends.models import resolve_model_path

    model = resolve_model_path(policy.model_name)
    return model, resolve_model_path(policy.tokenizer_name) if policy.tokenizer_name else model


class VLLMEngine(_NoInterrupt):
    """vLLM offline ``LLM`` (untested here)."""

    capabilities = manifest.VLLM.capabilities

    def __init__(self, model_path: str, **llm_kwargs: Any) -> None:
        import vllm

        self.llm = vllm.LLM(model=model_path, logprobs_mode="processed_logprobs", **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.weight_version = 0

    @classmethod
    def probe(cls) -> str | None:
        return manifest.VLLM.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any, model: Any = None, tokenizer: Any = None) -> VLLMEngine:
        policy = run_config.policy
        model_path, tokenizer_path = _model_and_tokenizer_paths(policy)
        return cls(
            model_path,
            tokenizer=tokenizer_path,
            dtype=policy.dtype,  # auto, float32, bfloat16, float16: vLLM's own names
            trust_remote_code=policy.trust_remote_code,
            max_num_seqs=policy.rollout.max_batch_size,
            gpu_memory_utilization=policy.rollout.gpu_memory_utilization,
            max_model_len=policy.max_prompt_length + policy.rollout.max_new_tokens,
            tensor_parallel_size=policy.rollout.tensor_parallel_size,
        )

    def generate(self, batch: Any, sampling: Any = None) -> Any:
        import vllm

        params = coerce_sampling(sampling)
        prompts = [{"prompt_token_ids": ids} for ids in _prompt_ids(batch)]
        per_row = [vllm.SamplingParams(  # a seed per row: row i's draw does not depend on the batch around it
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=_top_k(params),
            max_tokens=params.max_new_tokens,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            logprobs=0,
            seed=None if params.seed is None else params.seed + index,
        ) for index in range(len(prompts))]
        # one call for the whole batch, so vLLM schedules the rows together (continuous batching); its outputs
        # come back in the order of the prompts
        outputs = []
        for request in self.llm.generate(prompts, per_row, use_tqdm=False):
            result = request.outputs[0]
            log_probs = [step[token].logprob for step, token in zip(result.logprobs or [], result.token_ids)]
            outputs.append((list(result.token_ids), log_probs, result.finish_reason))
        pad = self.tokenizer.pad_token_id or 0
        return _rollout(batch, params, outputs, self.tokenizer, pad, self.weight_version)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int
    ) -> None:
        weights = _weight_list(named_tensors)
        self.llm.apply_model(lambda model: model.load_weights(weights))
        self.weight_version = int(version)


class SGLangEngine(_NoInterrupt):
    """SGLang offline ``Engine`` (untested here)."""

    capabilities = manifest.SGLANG.capabilities

    def __init__(self, model_path: str, **engine_kwargs: Any) -> None:
        import sglang

        self.engine = sglang.Engine(model_path=model_path, **engine_kwargs)
        self.tokenizer = _load_tokenizer(engine_kwargs.get("tokenizer_path") or model_path,
                                         bool(engine_kwargs.get("trust_remote_code", False)))
        self.weight_version = 0

    @classmethod
    def probe(cls) -> str | None:
        return manifest.SGLANG.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any, model: Any = None, tokenizer: Any = None) -> SGLangEngine:
        policy = run_config.policy
        model_path, tokenizer_path = _model_and_tokenizer_paths(policy)
        return cls(
            model_path,
            tokenizer_path=tokenizer_path,
            dtype=policy.dtype,  # auto, float32, bfloat16, float16: SGLang's own names
            trust_remote_code=policy.trust_remote_code,
            max_running_requests=policy.rollout.max_batch_size,
            mem_fraction_static=policy.rollout.gpu_memory_utilization,
            tp_size=policy.rollout.tensor_parallel_size,
        )

    def generate(self, batch: Any, sampling: Any = None) -> Any:
        params = coerce_sampling(sampling)
        sp = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": _top_k(params),
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": params.stop_token_ids,
            "ignore_eos": params.ignore_eos,
        }
        results = self.engine.generate(input_ids=_prompt_ids(batch), sampling_params=sp, return_logprob=True)
        outputs = []
        for result in results:
            info = result["meta_info"]
            steps = info.get("output_token_logprobs") or []
            tokens = [int(step[1]) for step in steps] or list(result.get("output_ids", []))
            log_probs = [float(step[0]) for step in steps] or [math.nan] * len(tokens)
            reason = (info.get("finish_reason") or {}).get("type")
            outputs.append((tokens, log_probs, reason))
        pad = self.tokenizer.pad_token_id or 0
        return _rollout(batch, params, outputs, self.tokenizer, pad, self.weight_version)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int
    ) -> None:
        weights = _weight_list(named_tensors)
        self.engine.update_weights_from_tensor(weights)
        self.weight_version = int(version)


def _atom_would_drop(atom: Any, engine_kwargs: Mapping[str, Any]) -> list[str]:
    """ATOM's ``LLMEngine(model, tokenizer=None, **kwargs)`` keeps only the ``kwargs`` that are fields of
    ``atom.config.Config`` and drops the rest without a word: the names of ``engine_kwargs`` it would drop."""
    import dataclasses
    import importlib
    import inspect

    config = importlib.import_module("atom.config").Config
    taken = {f.name for f in dataclasses.fields(config) if f.init}
    taken |= {name for name, p in inspect.signature(atom.LLMEngine).parameters.items()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return sorted(set(engine_kwargs) - taken)


def _cut_at_stop(tokens: list[int], stop_token_ids: list[int], reason: str | None) -> tuple[list[int], str | None]:
    """The response up to and including its first ``stop_token_ids`` token (finish reason stop), as an engine that
    stops there returns it (ATOM's SamplingParams take no stop token ids). ATOM's own reasons ``eos``,
    ``stop_sequence`` and ``stop_<token id>`` (its generation config's EOS ids) are a stop too."""
    stops = set(stop_token_ids)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], "stop"
    return tokens, "stop" if reason and (reason == "eos" or reason.startswith("stop")) else reason


class AtomEngine(_NoInterrupt):
    """AMD ATOM (ROCm/ATOM, built on AITER) ``LLMEngine`` (untested here).

    PyPI's ``atom`` is an unrelated namesake, so the probe checks for ATOM's own API
    (``atom.LLMEngine``, ``atom.SamplingParams`` and the ``atom.model_engine`` package), never
    the import name alone.
    """

    capabilities = manifest.ATOM.capabilities

    def __init__(self, model_path: str, **engine_kwargs: Any) -> None:
        import atom

        dropped = _atom_would_drop(atom, engine_kwargs)
        if dropped:
            raise ValueError(f"this ATOM's LLMEngine would silently drop {dropped} (not fields of atom.config.Config "
                             "nor LLMEngine arguments): upgrade ATOM, or leave the LumenRL keys that set them at "
                             "their defaults")
        self.llm = atom.LLMEngine(model_path, **engine_kwargs)
        self.tokenizer = self.llm.tokenizer
        self.weight_version = 0

    @classmethod
    def probe(cls) -> str | None:
        return manifest.ATOM.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any, model: Any = None, tokenizer: Any = None) -> AtomEngine:
        policy = run_config.policy
        model_path, tokenizer_path = _model_and_tokenizer_paths(policy)
        kwargs: dict[str, Any] = {
            "max_num_seqs": policy.rollout.max_batch_size,
            "gpu_memory_utilization": policy.rollout.gpu_memory_utilization,
        }
        if policy.trust_remote_code:  # a Config field since ATOM 2026-02; false is every ATOM's behaviour
            kwargs["trust_remote_code"] = True
        if policy.tokenizer_name:  # LLMEngine takes a tokenizer object (since 2026-03), no tokenizer path
            kwargs["tokenizer"] = _load_tokenizer(tokenizer_path, policy.trust_remote_code)
        return cls(model_path, **kwargs)

    def generate(self, batch: Any, sampling: Any = None) -> Any:
        import atom

        params = coerce_sampling(sampling)
        sp = atom.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=_top_k(params),
            max_tokens=params.max_new_tokens,
            ignore_eos=params.ignore_eos,
        )
        results = self.llm.generate(_prompt_ids(batch), sp)
        outputs = []
        for r in results:
            tokens, reason = _cut_at_stop(list(r["token_ids"]), params.stop_token_ids, r.get("finish_reason"))
            outputs.append((tokens, [math.nan] * len(tokens), reason))
        pad = self.tokenizer.pad_token_id or 0
        return _rollout(batch, params, outputs, self.tokenizer, pad, self.weight_version)

    def update_weights(self, named_tensors: Any, version: int) -> None:
        raise NotImplementedError(
            "ATOM exposes no public weight-update API; use rollout_engine=native for RL"
        )
