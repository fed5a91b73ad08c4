"""``native``: the embedded rollout engine, running the same HF modules the trainer uses.

Design (what the GPU-speed work builds on without a rewrite):

* a :class:`~lumenrl_backends.engines.kv_cache.SlotKVCache` allocated once: S slots x L
  columns, written in place, one slot per sequence, per-row write column and RoPE position;
* continuous batching: requests wait in a queue, get the lowest free slot, are prefilled in one
  left-padded batch, then join the shared decode step; a finished sequence frees its slot for the
  next queued request at once;
* a fixed-shape decode step per batch bucket (powers of two up to ``max_batch_size``) over slots
  ``0..b-1``: every input (tokens, positions, columns, mask) lives in preallocated tensors, and on
  CUDA the whole step (forward, sampling, state advance) is captured once per
  (bucket, kv_len, sampling mode) and replayed (:mod:`~lumenrl_backends.engines.graphs`);
  ``compile="full"`` additionally runs the decode forward through ``torch.compile`` (fused
  elementwise kernels; KV length then fixed at ``max_seq_len``, but the Triton decode attention
  stops each row at its write column, so the unused tail is not read; at most two compiles: the
  first bucket static, then one with a symbolic batch for all other buckets);
Kernel paths (the switches in ``backquotes`` below are fields of
:class:`~lumenrl_backends.engines.options.KernelOptions`, the ``kernels`` argument):

* projection fusion at load (``fuse_projections``, :mod:`~lumenrl_backends.engines.fusion`): one q/k/v
  and one gate/up GEMM per layer over fused storage that the named parameters view; ``fp8_row`` SwiGLU
  MLPs run SiLU * up and the down input's FP8 quantization as one kernel (``fp8_act_kernel``, default on)
  or in the gate/up epilogue (``fuse_fp8_mlp``, opt-in; lumenrl-quant :mod:`~lumenrl_quant.fused_mlp`);
  with an FP8 KV cache decode attention writes FP8 codes in V's units for ``o_proj`` (``fp8_attn_out``),
  RMSNorm hands its ``fp8_row`` consumer per-token FP8 input (``fp8_norm_quant``, on with ``compile="full"``
  and off the GPU), and each decode step's q/k norms, RoPE and KV write (FP8 included) run as one op
  (``fused_qk_rope``, :mod:`~lumenrl_backends.engines.triton_rope`, bit-identical to the HF sequence);
* decode GEMMs of plain 16-bit layers at M <= 128 rows on a Triton kernel (``decode_linear``, CUDA;
  :mod:`~lumenrl_backends.engines.triton_linear`; ``auto``: the shapes with measured launch parameters):
  q/k/v, o, gate/up with SwiGLU in its epilogue, down;
  with ``pdl`` (CUDA sm90+) these and inductor's kernels launch with programmatic dependent launch;
* MoE experts on lumenrl-quant's fused Triton kernel (``fused_moe``, :mod:`~lumenrl_backends.engines.moe`;
  ``auto``: CUDA, bf16), FP8 blockwise experts with ``fp8_block`` (requantized in place at ``update_weights``);
* decode attention packs grouped query heads onto their KV head instead of ``repeat_kv`` (one pass over
  the cache; :mod:`~lumenrl_backends.engines.attention`); ``kv_v_tiles`` (opt-in): V in (D, 128) tiles;
* prefill in chunks of at most ``prefill_chunk_tokens`` padded tokens (bounded activation
  memory), the admitted requests ordered by context length (longest first), a row under half its chunk's
  width starting a new chunk, so that a row is left-padded to at most twice its own length (continued rows
  beside fresh prompts); ``gpu_memory_utilization`` sizes the number of KV slots from free device memory;
* shared prefill (``share_prefill``, default on): rows of one context admitted together (a GRPO group's n samples
  of a prompt) run one prefill; the others take slots of their own with a copy of its cache columns and its last
  logits, then sample with their own seeds (:meth:`SlotKVCache.copy_slots`; off with R3, which records routes per
  prefilled row);
* small prefills replay CUDA graphs at bucketed shapes (:mod:`~lumenrl_backends.engines.prefill`: an eager
  prefill of a few tokens is all host time); larger ones run packed (``pack_prefill``: ``auto``, the default, where
  torch's varlen flash attention runs, CUDA 16-bit; ``on``; ``off``): the contexts back to back in one forward with no
  padding, each row's tokens at its own columns 0..len - 1 (the rows a partial rollout continues after a weight
  update: one forward);
* sampling fused into one batched call (:mod:`~lumenrl_backends.engines.sampling`) with counter-based
  per-request noise (interrupted sequences resume bit-identically); on CUDA one Triton pass over the logits
  (:mod:`~lumenrl_backends.engines.triton_sampling`), enabled after a self-check against the torch sampler;
* overlapped host sync (``overlap_sync``): each step's (token, log-prob) pairs are copied to a pinned
  host buffer without blocking, and while no request waits for a slot the next step is queued before the
  previous one is read (rows that turn out finished over-generate one token, discarded; a step whose shape
  the finishes would change is rolled back and redone); kept tokens and log-probs are unchanged;
* log-probs: ``log_softmax(logits.float() / temperature)`` of each sampled token, the
  contracts' convention, so they match the trainer's forward (bit for bit with ``exact_logprobs``:
  the trainer's batch-invariant operators of :mod:`~lumenrl_backends.exact`, no fusion, no compile).

Low precision (lumenrl-quant, :mod:`~lumenrl_backends.engines.quant`): ``quant_scheme`` swaps
the decoder linears for FP8/MX ``QuantizedLinear`` (requantized in place on every weight
update) and ``kv_cache_dtype="fp8"`` stores the KV cache in FP8 with per-layer scales that are
recalibrated at the first prefill after each update.

Interrupt/resume: :meth:`interrupt` (thread-safe) makes a running :meth:`generate` return at the next step with
``meta_info["interrupted"] = True``, unfinished rows marked "interrupted"; after :meth:`resume`, that batch passed to
:meth:`generate` continues them (prefilled under the *current* weights; earlier log-probs kept as generated).

Slots kept across an interrupt (:mod:`~lumenrl_backends.engines.kept_slots`): an interrupted row keeps its slot
until the next call, where its exact continuation resumes with no prefill, bit for bit the uninterrupted sequence
(an async rollouter's refill then prefills only its fresh rows); a weight update frees them unless
``keep_kv_on_update`` (``async_training.resume_kv=keep``) and no FP8 KV recalibration. Not with R3 or a draft.
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from lumenrl_backends import plugin_manifest as manifest
from lumenrl_backends.engines import quant as engine_quant
from lumenrl_backends.engines import triton_linear
from lumenrl_backends.engines.attention import ENGINE_ATTENTION, engine_attention, use_engine_attention
from lumenrl_backends.engines.fusion import fuse_projections as fuse_model_projections
from lumenrl_backends.engines.fusion import rope_tables, unfuse_projections
from lumenrl_backends.engines.graphs import (
    DecodeGraphs,
    engine_ordinal,
    graph_blocker,
    kv_bytes_per_token,
    slots_for_budget,
)
from lumenrl_backends.engines.kept_slots import KeptSlots
from lumenrl_backends.engines.kv_cache import (
    V_TILE,
    CacheView,
    SlotKVCache,
    decode_masks,
    to_attention_mask,
)
from lumenrl_backends.engines.loading import (
    engine_kwargs_from_config,
    eos_token_ids,
    pad_token_id,
    resolve_device,
    sliding_window_of,
)
from lumenrl_backends.engines.moe import install_fused_experts
from lumenrl_backends.engines.options import KernelOptions
from lumenrl_backends.engines.prefill import Prefill
from lumenrl_backends.engines.requests import (
    LENGTH,
    STOP,
    Request,
    build_rollout_batch,
    generated_tokens,
    group_by_context,
    requests_from_batch,
    rollout_meta,
    stop_ids_for,
)
from lumenrl_backends.engines.routes import engine_routes, r3_engine_kwargs
from lumenrl_backends.engines.sampling import SamplingParams, coerce_sampling, sample_tokens
from lumenrl_backends.engines.slots import SlotState, advance_slots, batch_buckets
from lumenrl_backends.engines.speculative import attach_from_config, speculative_generate
from lumenrl_backends.engines.triton_attention import kernel_agrees
from lumenrl_backends.engines.triton_sampling import fused_sample, fused_sampler_agrees
from lumenrl_backends.engines.weights import copy_weights_
from lumenrl_backends.engines.whole_graph import WholeGraph
from lumenrl_backends.exact import enable_exact, enable_exact_quantized, exact_token_log_probs

__all__ = ["NativeEngine", "sliding_window_of"]


@dataclass(slots=True)
class _Launched:
    """A queued decode step: its graph key, the rows it advanced, and where its results land."""

    key: tuple[int, int, str]
    slot_ids: list[int]
    requests: list[Request]
    buffer: torch.Tensor  # (2 * max_batch_size,) float64 host buffer; [:2b] = (tokens, log-probs)
    event: Any  # CUDA event after the copy (None on CPU: the copy is synchronous)


class NativeEngine:
    """Embedded rollout engine over an HF causal LM (see module docstring)."""

    kv_scale_recalibration = True  # from_config: quantization.rollout.kv_scale_recalibration
    capabilities = manifest.NATIVE.capabilities

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        max_seq_len: int = 512,
        kv_block: int | None = None,
        quant_scheme: Any = None,
        kv_cache_dtype: str | torch.dtype | None = "auto",
        cuda_graphs: bool = True,
        compile: str = "none",
        prefill_chunk_tokens: int = 16384,
        gpu_memory_utilization: float | None = None,
        kernels: KernelOptions | None = None,
        record_routes: bool = False, record_router_logits: bool = False, moe_router: str = "",
        exact_logprobs: bool = False,
        share_prefill: bool = True,
        pack_prefill: str = "auto",
    ) -> None:
        k = self.kernels = kernels or KernelOptions()
        if compile not in ("none", "full"):
            raise ValueError(f"compile={compile!r} is not supported; choose 'none' or 'full'")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if exact_logprobs and k.fused_moe == "on":
            raise ValueError("fused_moe='on' with exact_logprobs: the exact mode runs the HF modules; allowed: auto, off")
        if pack_prefill not in ("auto", "on", "off"):
            raise ValueError(f"pack_prefill={pack_prefill!r}; allowed: auto (where the varlen kernel runs), on, off")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 2 (one prompt token + one new token)")
        if kv_block is not None and (type(kv_block) is not int or kv_block < 1):
            raise ValueError(f"kv_block={kv_block!r}; allowed: None (64 on CUDA, exact lengths on the CPU) or an int >= 1")
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.exact, fuse_projections = exact_logprobs, k.fuse_projections and not exact_logprobs  # exact: HF modules
        self._pdl = k.pdl and not exact_logprobs and triton_linear.pdl_supported(self.device)  # CUDA sm90+
        if exact_logprobs:  # the trainer's batch-invariant operators (lumenrl_backends.exact)
            enable_exact(self.model, engine_settings=(quant_scheme, kv_cache_dtype, compile))
        self.quant_report = engine_quant.quantize_rollout_model(self.model, quant_scheme) if quant_scheme else None
        if exact_logprobs and quant_scheme:  # agreement with its own quantized model (exact/patch.py)
            enable_exact_quantized(self.model)
        # one q/k/v and one gate/up GEMM per layer; parameters become views of the fused storage
        self.fusion_report = fuse_model_projections(
            self.model, fp8_mlp=k.fuse_fp8_mlp, fp8_act_kernel=k.fp8_act_kernel, fp8_attn_out=k.fp8_attn_out,
            fp8_norm_quant=k.fp8_norm_quant and engine_quant.norm_quant_pays(compile, self.device),
            fused_qk_rope=k.fused_qk_rope, pdl=self._pdl, pdl_prefetch=k.prefetches(), fused_norm=k.fused_norm,
            rope_in_attention=k.rope_in_attention, tma=k.tma,
            decode_linear=k.decode_linear if self.device.type == "cuda" or triton_linear.INTERPRETED else "off",
        ) if fuse_projections else None
        if not fuse_projections:
            unfuse_projections(self.model)  # a model fused by an earlier engine runs its original modules
        if self.quant_report is not None:  # lumenrl-quant's Triton rowwise decode GEMMs join the PDL chain
            engine_quant.set_quantized_pdl(self.model, self._pdl, k.prefetches(), tma=k.tma)
        # MoE experts on the fused Triton kernel (FP8 experts with fp8_block), or HF's implementation
        self.moe = install_fused_experts(self.model, "off" if exact_logprobs else k.fused_moe, self.device, quant_scheme)
        self.tokenizer = tokenizer
        kv_dtype = engine_quant.kv_cache_dtype(kv_cache_dtype, self.device)
        if gpu_memory_utilization is not None and self.device.type == "cuda":
            element = torch.empty((), dtype=kv_dtype or next(self.model.parameters()).dtype).element_size()
            max_batch_size = slots_for_budget(
                free_bytes=torch.cuda.mem_get_info(self.device)[0],
                utilization=gpu_memory_utilization,
                max_seq_len=max_seq_len,
                bytes_per_token=kv_bytes_per_token(model.config, element),
                max_slots=max_batch_size,
            )
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.prefill_chunk_tokens, self.compile_mode = prefill_chunk_tokens, compile
        # decode attends to a multiple of kv_block cache columns: few distinct shapes on GPU (graphs),
        # exact lengths on CPU (no wasted attention)
        self.kv_block = kv_block or (64 if self.device.type == "cuda" else 1)
        self.weight_version = 0
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.pad_token_id = pad_token_id(tokenizer, self.eos_token_ids)
        self.window, self._mixed_layers = sliding_window_of(model.config)
        self._attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if self._attn in ("sdpa", ENGINE_ATTENTION) and use_engine_attention(self.model):
            self._attn = "sdpa"  # its attention is the engine's (by name, this model only), its masks are sdpa's
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        if k.kv_v_tiles and self._attn != "sdpa":
            raise ValueError(f"kv_v_tiles=True needs the engine's attention (attn_implementation 'sdpa'); the model "
                             f"uses {self._attn!r}")
        # V in (D, V_TILE) tiles, opt-in (kv_cache module doc; the kernel checked once on CUDA, as below)
        cache_dtype = kv_dtype or next(self.model.parameters()).dtype
        v_tiles = k.kv_v_tiles and (self.device.type != "cuda" or kernel_agrees(self.device, cache_dtype, v_tile=V_TILE))
        self.cache = SlotKVCache(num_layers=model.config.num_hidden_layers, max_slots=max_batch_size,
                                 max_len=max_seq_len, device=self.device, kv_dtype=kv_dtype,
                                 v_tile=V_TILE if v_tiles else 0)
        # the engine's attention reads an FP8 cache as stored: in the Triton kernel (checked once here
        # on CUDA) or dequantized just before SDPA (CPU); a failed check keeps the dequantized cache
        self.cache.raw_fp8_decode = self._attn == "sdpa" and (
            kv_dtype is None or self.device.type != "cuda" or kernel_agrees(self.device, kv_dtype)
        )
        self.slots = SlotState.allocate(max_batch_size, self.device)
        self.routes = engine_routes(self.model, record_routes, self.device, record_router_logits, moe_router, self.cache)
        self.buckets = batch_buckets(max_batch_size)
        self._interrupt = threading.Event()
        self._rows = torch.arange(max_batch_size, device=self.device)
        self._model_forward = self.model.forward
        self._masks, self._advance, self._rope = decode_masks, advance_slots, None  # the step's own ops
        if compile == "full":
            # automatic dynamic shapes: the first bucket compiles static, a second bucket recompiles once with a
            # symbolic batch that every later bucket reuses (measured configs use the static one)
            # pdl: inductor's kernels launch with programmatic dependent launch (each waits for the previous
            # kernel before its first dependent load), chaining with the decode GEMMs (engines/triton_linear.py)
            options = triton_linear.inductor_pdl_options(self._pdl)
            self._model_forward = WholeGraph(self.model.forward, options, what="model's forward")  # or loud pieces
            # mask building and state advance: a dozen tiny eager kernels (PDL chain breaks) become one kernel each
            self._masks, self._advance = (torch.compile(fn, options=options) for fn in (decode_masks, advance_slots))
            self._rope = rope_tables(self.model, self.fusion_report, options)  # once per step, not per layer
        self.ordinal = engine_ordinal()  # 0: the process's first engine (its graphs skip a gc pass: graphs.py)
        self.graphs = DecodeGraphs(self._decode_step, enabled=cuda_graphs and self.device.type == "cuda",
                                   collect=self.ordinal > 0, record=self.compile_mode != "full")
        blocker = graph_blocker(self.model) if self.graphs.enabled else None
        if blocker:
            self.graphs.enabled = False
            warnings.warn(f"native engine: no CUDA graphs ({blocker}); decoding eagerly", stacklevel=2)
        # small prefills from CUDA graphs, larger ones back to back with no padding (engines/prefill.py)
        self.prefill = Prefill(self, graphs=self.graphs.enabled, pack=pack_prefill)
        # rows of one context (a group's prompt) admitted together: one prefills, the others copy its K/V (module
        # doc); not with R3, whose routes are recorded per prefilled row
        self.share_prefill = share_prefill and not self.routes.enabled
        self.prefill_rows = {"prefilled": 0, "shared": 0}  # rows admitted by their own prefill / by a copy
        self.prefill_wait_s = 0.0  # host seconds waiting for admissions' first tokens (the GPU's prefill and more)
        # overlapped host sync: step N's (token, log-prob) pairs go to host buffers (pinned on CUDA,
        # two: N and N+1 in flight) while step N+1 is already queued (see _decode)
        self.overlap_sync = k.overlap_sync
        pinned = self.device.type == "cuda"
        self._host = [torch.empty(2 * max_batch_size, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]
        self._flip = 0
        self._inflight: _Launched | None = None
        self.speculation = {"launched": 0, "rolled_back": 0}  # speculative steps queued / undone (diagnostics)
        self._kept = KeptSlots(self.slots)  # interrupted rows' slots, held for their continuation (module doc)
        self.kept_slots = self._kept.counts  # rows kept / reclaimed (across_updates: after an update) / freed
        # Triton one-pass sampler on CUDA, after a self-check against the torch sampler (None: not checked yet)
        self._fused_ok: bool | None = None if k.fused_sampling and self.device.type == "cuda" else False
        self.draft, self.spec_tokens = None, 0  # speculative decoding: engines/speculative.attach_draft

    # ------------------------------------------------------------------ construction
    @classmethod
    def probe(cls) -> str | None:
        return manifest.NATIVE.unavailable_reason()

    @classmethod
    def from_config(
        cls, run_config: Any, model: nn.Module | None = None, tokenizer: Any = None
    ) -> NativeEngine:
        """Build from a RunConfig: model/tokenizer from ``policy`` unless given, sizes from ``policy.rollout``."""
        rollout, rollout_quant = run_config.policy.rollout, run_config.quantization.rollout
        engine = cls(
            **engine_kwargs_from_config(run_config, model, tokenizer),
            quant_scheme=engine_quant.rollout_scheme(rollout_quant),
            kv_cache_dtype=rollout_quant.kv_cache_dtype,
            cuda_graphs=rollout.cuda_graphs,
            compile=rollout.compile,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            kernels=KernelOptions(fuse_projections=rollout.fuse_projections, fused_moe=rollout.fused_moe,
                                  overlap_sync=rollout.overlap_sync, fuse_fp8_mlp=rollout_quant.fuse_mlp,
                                  decode_linear=rollout.decode_linear, pdl=rollout.pdl),
            exact_logprobs=rollout.exact_logprobs,
            share_prefill=rollout.share_prefill, pack_prefill=rollout.pack_prefill, kv_block=rollout.kv_block or None,
            **r3_engine_kwargs(run_config.moe.r3),
        )
        engine.kv_scale_recalibration = rollout_quant.kv_scale_recalibration
        attach_from_config(engine, rollout.speculative)  # speculative decoding when draft_path is set
        return engine

    # ------------------------------------------------------------------ control
    def interrupt(self) -> None:
        """Stop in-flight generation at the next step (thread-safe); stays stopped until resume()."""
        self._interrupt.set()

    def resume(self) -> None:
        """Allow generation again; pass an interrupted batch to generate() to continue it."""
        self._interrupt.clear()

    @property
    def interrupted(self) -> bool:
        return self._interrupt.is_set()

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int
    ) -> int:
        """Copy weights into the engine model in place (no reallocation); returns tensors copied."""
        # FP8 KV scales follow the new policy unless quantization.rollout.kv_scale_recalibration=false
        recalibrate = self.cache.kv_dtype is not None and self.kv_scale_recalibration
        if not self.keep_kv_on_update or recalibrate:
            self._kept.free()  # their caches hold the old weights' keys and values
        count = copy_weights_(self.model, named_tensors, self.moe.reloaders)  # requantizes FP8/MX weights in place
        self.weight_version = int(version)
        self.cache.recalibrate = recalibrate
        return count

    @property
    def keep_kv_on_update(self) -> bool:
        """Kept slots survive :meth:`update_weights` (``async_training.resume_kv=keep``; module doc)."""
        return self._kept.keep_on_update

    @keep_kv_on_update.setter
    def keep_kv_on_update(self, value: bool) -> None:
        self._kept.keep_on_update = bool(value)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()  # not inference_mode: the returned tensors feed the trainer's autograd
    def generate(self, batch: Any, sampling: Any = None) -> Any:
        """Generate for every row of ``batch``; returns the rollout DataProto (contracts layout)."""
        params = coerce_sampling(sampling)
        if self.draft is not None:  # draft-then-verify (engines/speculative.py)
            self._kept.free()
            return speculative_generate(self, batch, params)
        requests, prompts, prompt_mask = requests_from_batch(batch, params)
        stops = stop_ids_for(params, self.eos_token_ids)
        start, before = time.perf_counter(), generated_tokens(requests)
        self._prefill_seconds = 0.0
        self._run([r for r in requests if not r.done], params, stops)
        if self.device.type == "cuda":  # this thread's stream: a rollouter thread's own, not the trainer's work
            torch.cuda.current_stream(self.device).synchronize()
        meta = rollout_meta(requests, params, weight_version=self.weight_version,
                            tokens=generated_tokens(requests) - before, seconds=time.perf_counter() - start,
                            prefill_seconds=self._prefill_seconds,
                            cuda_graphs=self.graphs.enabled and self.graphs.error is None)
        self.routes.finish(requests, batch, meta)  # R3: rows finished before an interrupt keep their routes
        return build_rollout_batch(requests, prompts, prompt_mask, width=params.max_new_tokens, pad_id=self.pad_token_id,
                                   tokenizer=self.tokenizer, meta_info=meta)

    def _run(self, requests: list[Request], params: SamplingParams, stops: frozenset[int]) -> None:
        active = self._kept.reclaim(requests, params, self.weight_version)  # rows kept by an interrupted call
        resumed = {id(r) for r in active.values()}
        queue: deque[Request] = deque(r for r in requests if id(r) not in resumed)
        keep = False
        try:
            while (queue or active) and not self._interrupt.is_set():
                if queue and self.slots.free:
                    admitted = [queue.popleft() for _ in range(min(len(queue), len(self.slots.free)))]
                    # longest first: chunks of like lengths (little left padding), and the continued long-tail
                    # rows take the lowest slots, the fresh ones above them (their early finishes shrink the bucket)
                    admitted.sort(key=lambda r: -len(r.context))
                    leads, copies = group_by_context(admitted) if self.share_prefill else (admitted, {})
                    tick = time.perf_counter()
                    with record_function("lumenrl/prefill"):  # a range of a torch.profiler trace (trainer phases)
                        for chunk, packed in self.prefill.plan(leads, params.max_new_tokens):
                            self._admit(chunk, params, active, stops, copies, packed=packed)
                    self._prefill_seconds += time.perf_counter() - tick
                if active and not self._interrupt.is_set():
                    self._decode(active, params, stops, speculate=self.overlap_sync and not queue)
            keep = bool(active) and not self.routes.enabled  # interrupted: the unfinished rows keep their slots
        finally:
            if keep:
                self._keep(active, params)
            else:
                self.routes.take_all(active, self.slots.host_columns, 1 if self._inflight is not None else 0)
                self._inflight = None  # a speculative step left by an interrupt: dropped (slots are reset below)
                self.slots.release_all()

    def _keep(self, active: dict[int, Request], params: SamplingParams) -> None:
        """An interrupted call's unfinished rows keep their slots (module doc). A step queued past the last recorded
        one is undone for them first, so each slot's state is that of its row's last recorded token."""
        step, self._inflight = self._inflight, None
        if step is not None:
            rows = [slot for slot in step.slot_ids if slot in active]
            if rows:
                self._undo_step(rows, [active[slot].response[-1] for slot in rows])
        self._kept.keep(active, params, self.weight_version)

    def _undo_step(self, rows: list[int], tokens: list[int]) -> None:
        """Undo one queued step's state advance for ``rows``: each takes ``tokens`` (its last recorded token) as its
        next input again, a column, position and counter back (the column is rewritten by the next step)."""
        s = self.slots
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        for state in (s.columns, s.positions, s.counters):
            state[index] -= 1
        s.tokens[index] = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        for slot in rows:
            s.host_columns[slot] -= 1

    def _record(
        self,
        slot_ids: list[int],
        tokens: list[float],
        log_probs: list[float],
        params: SamplingParams,
        stops: frozenset[int],
        active: dict[int, Request],
        lag: int = 0,
    ) -> None:
        """Append one sampled token (host values, aligned with ``slot_ids``) to each active request; a finished
        one leaves ``active``, and the slots of all that finished on this step are released together.
        ``lag``: steps already launched past this one (their columns are in the host mirror)."""
        finished = []
        for slot, token, log_prob in zip(slot_ids, tokens, log_probs):
            request = active[slot]
            request.response.append(int(token))
            request.log_probs.append(log_prob)
            if request.response[-1] in stops:
                request.finish_reason = STOP
            elif len(request.response) >= request.cap(params) or self.slots.host_columns[slot] - lag >= self.max_seq_len:
                request.finish_reason = LENGTH
            if request.done:
                self.routes.take(request, slot, self.slots.host_columns[slot] - lag)
                del active[slot]
                finished.append(slot)
        self.slots.release_many(finished)
        self.routes.flush()  # R3: the rows of this step's finished requests, one gather (before a slot is reused)

    @staticmethod
    def _sampling_mode(params: SamplingParams) -> str:
        if params.temperature <= 0:
            return "greedy"
        return "restrict" if params.top_k > 0 or params.top_p < 1.0 else "plain"

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor | slice, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slots
        if mode != "restrict" and self._fused_sampling_ok():
            try:
                return fused_sample(
                    logits,
                    temperature=s.temperature[rows],
                    seeds=s.seeds[rows],
                    counters=s.counters[rows],
                    greedy_only=mode == "greedy",
                )
            except Exception as err:  # noqa: BLE001 - a kernel that fails to build: keep the torch sampler
                if torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(f"native engine: fused sampler failed ({err}); using the torch sampler", stacklevel=2)
                self._fused_ok = False
        return sample_tokens(
            logits,
            temperature=s.temperature[rows],
            top_k=s.top_k[rows],
            top_p=s.top_p[rows],
            seeds=s.seeds[rows],
            counters=s.counters[rows],
            restrict=mode == "restrict",
            greedy_only=mode == "greedy",
        )

    def _fused_sampling_ok(self) -> bool:
        """Decided once, eagerly (the first sample of a run is a prefill's, never inside a capture)."""
        if self._fused_ok is None:
            if torch.cuda.is_current_stream_capturing():
                return False
            self._fused_ok = fused_sampler_agrees(self.device)
        return self._fused_ok

    # ------------------------------------------------------------------ prefill
    def _admit(
        self,
        admitted: list[Request],
        params: SamplingParams,
        active: dict[int, Request],
        stops: frozenset[int],
        copies: dict[int, list[Request]] | None = None,
        packed: bool = False,
    ) -> None:
        """Prefill ``admitted`` into free slots (``packed``: back to back, engines/prefill.py) and sample each row's
        first token; the rows that ``copies`` lists under an admitted one take slots of their own with a copy of its
        K/V and its last logits (no forward)."""
        contexts = [r.context for r in admitted]
        width = max(len(c) for c in contexts)
        if width >= self.max_seq_len:
            raise ValueError(
                f"a prompt (+ partial response) has {width} tokens; max_seq_len={self.max_seq_len} leaves no room to generate"
            )
        slot_ids = self.slots.take(len(admitted))
        rows = torch.tensor(slot_ids, dtype=torch.int64, device=self.device)
        if packed:  # each row at columns 0..len - 1
            logits = self.prefill.packed(contexts, rows)
            width = max(len(c) for c in contexts)
        else:  # left-padded: every row's context ends at column ``width``
            _, mask, _, logits, _ = self.prefill(contexts, rows, room=params.max_new_tokens)
            width = mask.shape[1]
        self.cache.recalibrate = False
        self.prefill_rows["prefilled"] += len(admitted)
        followers = [(i, r) for i, lead in enumerate(admitted) for r in (copies or {}).get(id(lead), ())]
        if followers:
            source = torch.tensor([i for i, _ in followers], dtype=torch.int64, device=self.device)
            copy_ids = self.slots.take(len(followers))
            copy_rows = torch.tensor(copy_ids, dtype=torch.int64, device=self.device)
            self.cache.copy_slots(rows[source], copy_rows, width)
            admitted, slot_ids = admitted + [r for _, r in followers], slot_ids + copy_ids
            rows, logits = torch.cat([rows, copy_rows]), torch.cat([logits, logits[source]])
            self.prefill_rows["shared"] += len(followers)
        self.slots.admit(rows, [r.seed for r in admitted], params)
        self.slots.counters[rows] = torch.tensor([len(r.response) for r in admitted], device=self.device)
        tokens, log_probs = self._sample(logits, rows, self._sampling_mode(params))
        if self.exact:  # the trainer's batch-invariant log-softmax (greedy rows: temperature 1)
            log_probs = exact_token_log_probs(logits, tokens, self.slots.temperature[rows])
        s = self.slots
        lengths = [len(r.context) for r in admitted]  # each row's next position; its next column, packed
        columns = lengths if packed else [width] * len(admitted)
        s.tokens[rows], s.columns[rows] = tokens, torch.tensor(columns, device=self.device)
        s.positions[rows] = torch.tensor(lengths, device=self.device)
        s.counters[rows] += 1
        for slot, column in zip(slot_ids, columns):
            s.host_columns[slot] = column
        active.update(zip(slot_ids, admitted))
        tick = time.perf_counter()
        first_tokens, first_log_probs = tokens.tolist(), log_probs.tolist()  # the host waits for the GPU here
        self.prefill_wait_s += time.perf_counter() - tick
        self._record(slot_ids, first_tokens, first_log_probs, params, stops, active)

    # ------------------------------------------------------------------ decode
    def _bucket(self, rows_needed: int) -> int:
        return next(b for b in self.buckets if b >= rows_needed)

    def _step_key(self, active: dict[int, Request], params: SamplingParams, lag: int = 0) -> tuple[int, int, str]:
        """(bucket, kv_len, sampling mode) of the next step over ``active`` (host mirror: no device sync)."""
        longest = max(self.slots.host_columns[slot] for slot in active) - lag + 1
        kv_len = min(self.max_seq_len, -(-longest // self.kv_block) * self.kv_block)
        if self.compile_mode == "full":
            kv_len = self.max_seq_len  # one compiled shape per bucket
        return self._bucket(max(active) + 1), kv_len, self._sampling_mode(params)

    def _launch(self, active: dict[int, Request], params: SamplingParams) -> _Launched:
        """Queue one decode step and the copy of its results to a host buffer; no host sync."""
        key = self._step_key(active, params)
        packed = self.graphs(*key)[2]  # (2, b) float64: tokens, log-probs
        buffer, event = self._host[self._flip], self._events[self._flip]
        self._flip ^= 1
        buffer[: packed.numel()].copy_(packed.reshape(-1), non_blocking=True)
        if event is not None:
            event.record()
        slot_ids = sorted(active)
        for slot in slot_ids:
            self.slots.host_columns[slot] += 1
        return _Launched(key, slot_ids, [active[slot] for slot in slot_ids], buffer, event)

    def _decode(
        self, active: dict[int, Request], params: SamplingParams, stops: frozenset[int], speculate: bool = False
    ) -> None:
        """Record one decode step. With ``speculate`` the next step is queued *before* this one's
        results are read, assuming no row finishes (its device work overlaps this host sync and
        bookkeeping). Rows that did finish get their extra token discarded; if the finishes change
        the step's shape (bucket or kv_len), the speculative step is rolled back and redone, so kept
        tokens and log-probs are those of the unspeculated loop."""
        step, self._inflight = self._inflight or self._launch(active, params), None
        s = self.slots
        if (speculate and any(len(r.response) + 1 < r.cap(params) for r in active.values())  # not all last tokens
                and all(s.host_columns[slot] < self.max_seq_len for slot in active)):
            self._inflight = self._launch(active, params)  # every row's next column is in the cache
            self.speculation["launched"] += 1
        if step.event is not None:
            step.event.synchronize()
        batch = step.key[0]
        host = step.buffer[: 2 * batch].view(2, batch).tolist()
        kept = [slot for slot, request in zip(step.slot_ids, step.requests) if active.get(slot) is request]
        lag = 1 if self._inflight is not None else 0
        self._record(kept, [host[0][i] for i in kept], [host[1][i] for i in kept], params, stops, active, lag)
        spec = self._inflight
        if spec is None:
            return
        if not active:  # everything finished: the released slots are reset after the speculative step
            self._inflight = None
        elif self._step_key(active, params, lag=1) != spec.key:
            self._inflight = None  # undo its state advance for the rows that continue; redone next call
            self.speculation["rolled_back"] += 1
            rows = sorted(active)
            self._undo_step(rows, [int(host[0][i]) for i in rows])

    def _decode_step(self, batch: int, kv_len: int, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward + sampling + state advance over slots 0..batch-1 (what one CUDA graph holds)."""
        s = self.slots
        logits = self._decode_forward(batch, kv_len)  # (b, V)
        tokens, log_probs = self._sample(logits, slice(0, batch), mode)
        if self.exact:
            log_probs = exact_token_log_probs(logits, tokens, s.temperature[:batch])
        packed = self._advance(s.tokens, s.columns, s.positions, s.counters, s.occupied, batch, tokens, log_probs)
        return tokens, log_probs, packed

    def _decode_forward(self, batch: int, kv_len: int) -> torch.Tensor:
        """One fixed-shape decode forward over slots 0..batch-1; no host sync, no host->device copy."""
        s = self.slots
        rows = self._rows[:batch]
        columns = s.columns[:batch]
        # the written column becomes valid; ``full`` (no window) only for models that mix window and full layers
        allowed, full = self._masks(self.cache.valid, columns, batch, kv_len, self.window, self._mixed_layers)
        ids, positions = s.tokens[:batch, None], s.positions[:batch, None]
        self.cache.set_view(CacheView(rows=rows, columns=columns[:, None], decode=True, kv_len=kv_len,
                                      rope=None if self._rope is None else self._rope(positions)))
        self.routes.decode(batch, columns)  # R3: static-index writes, captured with the step
        return self._forward(ids, positions, allowed, full, forward=self._model_forward).logits[:, -1]

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        allowed_full: torch.Tensor,
        forward: Any = None,
        layer_ids: tuple[int, ...] | None = None,
        logits_to_keep: int | torch.Tensor = 1,
    ) -> Any:
        """The model's forward through the engine cache and attention -> its output (logits of the last column, or of
        the columns ``logits_to_keep`` lists; with ``layer_ids``, all hidden states too)."""
        dtype = next(self.model.parameters()).dtype
        mask: Any = to_attention_mask(allowed, self._attn, dtype)
        if self._mixed_layers:
            mask = {
                "sliding_attention": mask,
                "full_attention": to_attention_mask(allowed_full, self._attn, dtype),
            }
        with engine_attention(self.cache):
            out = (forward or self.model)(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **({"output_hidden_states": True} if layer_ids is not None else {}),
                **{self._cache_kwarg: self.cache},
            )
        self.cache.set_view(None)
        self.routes.done()
        return out
