"""``hf``: the baseline rollout engine, ``transformers`` ``model.generate``.

Same interface and output layout as ``native``. Log-probs come from ``output_logits=True`` (the
raw logits of every step, before any processor) as ``log_softmax(logits.float() / temperature)``
of the chosen token, the contracts' convention. Differences from ``native``, by construction of
``generate``: sampling draws from the global torch RNG (``sampling.seed`` seeds it for the
call, in a forked RNG state), so per-request reproducibility across different batch
compositions is not guaranteed; an interrupt stops the whole batch through a stopping criterion,
and continuation re-generates from prompt + partial response.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.engines.loading import (
    engine_kwargs_from_config,
    eos_token_ids,
    pad_token_id,
    resolve_device,
)
from lumenrl_backends.engines.requests import (
    LENGTH,
    STOP,
    Request,
    build_rollout_batch,
    generated_tokens,
    left_pad,
    requests_from_batch,
    rollout_meta,
    stop_ids_for,
)
from lumenrl_backends.engines.routes import record_generate_routes
from lumenrl_backends.engines.sampling import SamplingParams, coerce_sampling
from lumenrl_backends.engines.weights import copy_weights_

__all__ = ["HFEngine"]


class _StopOnEvent(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full(
            (input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device
        )


class HFEngine:
    """Rollout through ``model.generate`` (see module docstring)."""

    capabilities = manifest.HF.capabilities

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        max_seq_len: int = 512,
        record_routes: bool = False,
        moe_router: str = "",
    ) -> None:
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.weight_version = 0
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.pad_token_id = pad_token_id(tokenizer, self.eos_token_ids)
        self._interrupt = threading.Event()
        self.routes = None  # R3: the routers' controller (record mode around each generate)
        if record_routes:
            from lumenrl_moe import install_routing

            self.routes = install_routing(self.model, router_cls=moe_router or None)

    @classmethod
    def probe(cls) -> str | None:
        return manifest.HF.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any, model: nn.Module | None = None, tokenizer: Any = None) -> HFEngine:
        r3 = run_config.moe.r3
        return cls(**engine_kwargs_from_config(run_config, model, tokenizer), record_routes=r3.enabled, moe_router=r3.router)

    def interrupt(self) -> None:
        self._interrupt.set()

    def resume(self) -> None:
        self._interrupt.clear()

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int
    ) -> int:
        count = copy_weights_(self.model, named_tensors)
        self.weight_version = int(version)
        return count

    @torch.no_grad()
    def generate(self, batch: Any, sampling: Any = None) -> Any:
        params = coerce_sampling(sampling)
        requests, prompts, prompt_mask = requests_from_batch(batch, params)
        stops = stop_ids_for(params, self.eos_token_ids)
        start, before = time.perf_counter(), generated_tokens(requests)
        pending = [r for r in requests if not r.done]
        for first in range(0, len(pending), self.max_batch_size):
            if self._interrupt.is_set():
                break
            self._generate_chunk(pending[first : first + self.max_batch_size], params, stops)
        meta = rollout_meta(
            requests,
            params,
            weight_version=self.weight_version,
            tokens=generated_tokens(requests) - before,
            seconds=time.perf_counter() - start,
        )
        return build_rollout_batch(
            requests,
            prompts,
            prompt_mask,
            width=params.max_new_tokens,
            pad_id=self.pad_token_id,
            tokenizer=self.tokenizer,
            meta_info=meta,
        )

    def _generation_config(
        self, params: SamplingParams, stops: frozenset[int], max_new: int
    ) -> GenerationConfig:
        sample = params.temperature > 0
        return GenerationConfig(
            max_new_tokens=max_new,
            do_sample=sample,
            num_beams=1,
            temperature=params.temperature if sample else None,
            top_k=params.top_k if sample and params.top_k > 0 else None,
            top_p=params.top_p if sample and params.top_p < 1.0 else None,
            eos_token_id=sorted(stops),
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )

    def _generate_chunk(self, chunk: list[Request], params: SamplingParams, stops: frozenset[int]) -> None:
        ids, mask = left_pad([r.context for r in chunk], self.pad_token_id, self.device)
        budgets = [params.max_new_tokens - len(r.response) for r in chunk]
        max_new = min(max(budgets), self.max_seq_len - ids.shape[1])
        if max_new < 1:
            raise ValueError(
                f"prompts of {ids.shape[1]} tokens leave no room under max_seq_len={self.max_seq_len}"
            )
        config = self._generation_config(params, stops, max_new)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            with record_generate_routes(self.model, self.routes, ids.shape, max_new) as recorded:
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=config,
                    stopping_criteria=StoppingCriteriaList([_StopOnEvent(self._interrupt)]),
                )
        new = out.sequences[:, ids.shape[1] :]  # (n, t)
        temp = params.temperature if params.temperature > 0 else 1.0
        logits = torch.stack(out.logits, dim=1)[:, : new.shape[1]].float() / temp  # (n, t, V)
        log_probs = torch.log_softmax(logits, dim=-1).gather(2, new[..., None]).squeeze(-1)
        for i, (request, tokens, lps, budget) in enumerate(zip(chunk, new.tolist(), log_probs.tolist(), budgets)):
            context = len(request.context)
            self._absorb(request, tokens, lps, budget, stops, ids.shape[1])
            if recorded is not None:  # the fed tokens: this context, then all kept new tokens but the last
                width, kept = ids.shape[1], len(request.context) - context
                request.routes = recorded[i, width - context : width + kept - 1].cpu()

    def _absorb(
        self,
        request: Request,
        tokens: list[int],
        log_probs: list[float],
        budget: int,
        stops: frozenset[int],
        width: int,
    ) -> None:
        for token, log_prob in zip(tokens[:budget], log_probs[:budget]):
            request.response.append(token)
            request.log_probs.append(log_prob)
            if token in stops:
                request.finish_reason = STOP
                return
        if len(tokens) >= budget or width + len(tokens) >= self.max_seq_len:
            request.finish_reason = LENGTH
