"""Projection fusion for the native engine: one q/k/v GEMM and one gate/up GEMM per layer.

In decode (M = batch rows, e.g. 64) the HF modules run 7 GEMMs per layer; ``q_proj``/``k_proj``/
``v_proj`` and ``gate_proj``/``up_proj`` read the same input, so one GEMM over the concatenated
weight reads the input once, launches one kernel and runs a wider N (better tensor-core use at
small M). :func:`fuse_projections` does this at engine load, in place:

* storage: one fused tensor ``cat([q, k, v])`` (rows) per attention, ``cat([gate, up])`` per dense
  MLP (biases too); the original ``q_proj.weight`` etc. become :class:`~torch.nn.Parameter` *views*
  (row slices) of it. The module tree, names and ``state_dict`` stay identical, and the engine's
  in-place weight sync (``copy_`` into each named parameter,
  :mod:`~lumenrl_backends.engines.weights`) writes straight into the fused storage: nothing on the
  sync path changes. Data pointers never move, so CUDA graphs stay valid across syncs.
* quantized layers (lumenrl-quant ``QuantizedLinear``, after ``quant_scheme``): the group is fused
  when every member has the same scheme/FP8 dtype and row-aligned scales (``fp8_row``, MX schemes,
  ``fp8_block`` only when each part's N is a whole number of 128-row blocks); the fused layer is a
  ``QuantizedLinear`` whose ``weight``/``weight_scale`` are the concatenations, and each member's
  buffers become views of them. ``reload_`` (requantize-on-sync) copies into the member's buffers,
  i.e. into the fused ones. Per-tensor scales (``fp8_tensor``) are not fusable: left alone.
* forward: the module's class is swapped for a subclass (same name space, ``isinstance`` holds)
  whose ``forward`` runs the fused GEMM and splits, then uses the HF module's own q/k norms (Qwen3),
  its family's ``apply_rotary_pos_emb`` and the attention interface, exactly as transformers'
  forward does (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE attention; dense ``*MLP``).
  The fused attention runs only for the engine's own
  :class:`~lumenrl_backends.engines.kv_cache.SlotKVCache` forwards with autograd off, the fused MLP
  whenever autograd is off; anything else (a trainer or HF ``generate`` sharing the module, a
  gradient-enabled forward) runs the original forward on the member views, so gradients and other
  caches behave exactly as before.

``fused_qk_rope`` (default on): in the engine's decode step (one token per row, rows ``0..b-1``, or
q > 1 tokens per row at consecutive columns in speculative decoding's verify forward) the
q/k RMSNorms (Qwen3), RoPE and the KV-cache write run as one kernel,
:func:`~lumenrl_backends.engines.triton_rope.decode_qk_rope_kv_write`, instead of the norm modules,
``apply_rotary_pos_emb`` and ``cache.update`` (same rounding sequence; see that module). It is set
per attention only where the HF pieces compute what the op computes (checked at fusion on small
inputs: the family's ``apply_rotary_pos_emb`` and the module's own q/k norms); at run time it falls
back to the HF sequence for prefill, cos/sin not ``(b, q, D)`` in the model dtype, and an FP8 cache
without per-tensor scales yet (the first prefill calibrates them through ``update``).

``decode_linear`` (the engine's ``KernelOptions.decode_linear``): the fused modules' 16-bit GEMMs (q/k/v,
o; gate/up with SwiGLU, down) call :func:`~lumenrl_backends.engines.triton_linear.decode_linear`, which
runs its Triton kernel at decode-sized row counts and cuBLAS otherwise; ``decode_linear_skipped`` in the
report says which GEMMs stay on ``F.linear`` and why.

The fused modules are kept outside the module tree (a plain attribute), so ``named_modules``,
``named_parameters`` and ``state_dict`` are unchanged. DeepSeek MLA (no separate q/k/v), MoE
expert banks and any unknown class are left untouched (DeepSeek-V3 / GLM-4-MoE: their dense and
shared-expert MLPs are fused, attention is not).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lumenrl_backends.engines.fused_storage import _fuse_group, _FusedDense, _FusedQuantized

__all__ = ["FusionReport", "fuse_projections", "rope_tables", "unfuse_projections", "ATTENTION_CLASSES", "MLP_CLASSES"]

# class name -> how the HF forward passes ``sliding_window`` to the attention function:
# None (not passed), "self" (self.sliding_window), "config" (getattr(config, "sliding_window", None))
ATTENTION_CLASSES: dict[str, str | None] = {
    "LlamaAttention": None,
    "Qwen2Attention": "self",
    "Qwen3Attention": "self",
    "Qwen3MoeAttention": "self",
    "MistralAttention": "config",
    "MixtralAttention": "config",
}
# dense MLPs (also MoE shared experts / dense layers) whose forward is down(act(gate(x)) * up(x))
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "Qwen3MoeMLP", "DeepseekV3MLP", "Glm4MoeMLP"})
_FUSED_ATTR = "_lumenrl_fused"  # instance attribute (outside the module tree) holding the fused linear
_SWIGLU_ATTR = "_lumenrl_swiglu_fp8"  # instance attribute: "group" / "token" when the MLP runs a lumenrl-quant FP8 SwiGLU


@dataclass
class FusionReport:
    attention: list[str] = field(default_factory=list)  # module names whose q/k/v were fused
    mlp: list[str] = field(default_factory=list)  # module names whose gate/up were fused
    mlp_fp8: list[str] = field(default_factory=list)  # fused MLPs that run lumenrl-quant's FP8 SwiGLU (opt-in)
    mlp_fp8_token: list[str] = field(default_factory=list)  # MLPs whose SiLU * up + per-token quantize is one kernel
    attention_fp8_out: list[str] = field(default_factory=list)  # attentions whose decode output goes to o_proj as FP8
    attention_fused_rope: list[str] = field(default_factory=list)  # decode q/k norm + RoPE + KV write in one kernel
    attention_fused_rope_skipped: dict[str, str] = field(default_factory=dict)  # asked for, but why not
    attention_rope_folded: list[str] = field(default_factory=list)  # ... and that inside the attention kernel
    layers_fp8_norm: list[str] = field(default_factory=list)  # decoder layers whose norms emit per-token FP8
    layers_fused_norm: list[str] = field(default_factory=list)  # decoder layers whose norms/adds run in the GEMMs
    layers_fused_norm_skipped: dict[str, str] = field(default_factory=dict)  # asked for, but why not
    mlp_fp8_skipped: dict[str, str] = field(default_factory=dict)  # fused quantized MLP -> why not the FP8 SwiGLU
    decode_linear: list[str] = field(default_factory=list)  # modules with a decode GEMM on the Triton decode kernel
    decode_linear_skipped: dict[str, str] = field(default_factory=dict)  # asked for: why not (one or both GEMMs)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why not

    @property
    def fused(self) -> int:
        return len(self.attention) + len(self.mlp)


def _engine_forward(cache: Any) -> bool:
    """The fused path: the engine's own cache, no autograd (everything else runs the HF forward)."""
    from lumenrl_backends.engines.kv_cache import SlotKVCache

    return isinstance(cache, SlotKVCache) and not torch.is_grad_enabled()


def _family_module(cls: type) -> Any:
    for klass in cls.__mro__:
        if klass.__name__ in ATTENTION_CLASSES or klass.__name__ in MLP_CLASSES:
            return sys.modules[klass.__module__]
    raise TypeError(
        f"{cls.__name__} is not a fusable transformers module; allowed: subclasses of "
        f"{sorted(ATTENTION_CLASSES)} or {sorted(MLP_CLASSES)}"
    )


def _attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    cache = cache if cache is not None else past_key_values
    if not _engine_forward(cache):
        return self._lumenrl_original_forward(
            hidden_states, position_embeddings, attention_mask, **{self._lumenrl_cache_kwarg: cache}, **kwargs
        )
    family = self._lumenrl_family
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    fused = getattr(self, _FUSED_ATTR)
    prequantized = kwargs.pop("lumenrl_prequantized", None)  # (codes, scales) of the normed input (layer forward)
    norm, residual = kwargs.pop("lumenrl_norm", None), kwargs.pop("lumenrl_residual", None)  # fused_layers: norm_gemm
    decode = self.__dict__.get(_DECODE_ATTR)  # the op picks kernel or cuBLAS by the row count (no guard here)
    rows = input_shape.numel()
    if (norm is not None or residual is not None) and not _both_decode(decode, self.o_proj, prequantized):
        raise RuntimeError(f"{type(self).__name__}: a fused norm or residual needs q/k/v and o on the decode kernel")
    if prequantized is None and decode is not None and decode.first:
        query, key, value = _decode_linear(hidden_states.reshape(rows, -1), fused.weight, fused.bias, decode,
                                           norm=norm).reshape(*input_shape, -1).split(fused.sizes, dim=-1)
    elif prequantized is None:
        query, key, value = fused(hidden_states)
    else:
        qkv = fused.linear.forward_quantized(*prequantized, hidden_states.dtype)
        query, key, value = qkv.reshape(*input_shape, -1).split(fused.sizes, dim=-1)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    functions = family.ALL_ATTENTION_FUNCTIONS
    implementation = self.config._attn_implementation
    if hasattr(functions, "get_interface"):
        attention = functions.get_interface(implementation, family.eager_attention_forward)
    else:  # older transformers
        attention = family.eager_attention_forward if implementation == "eager" else functions[implementation]
    from lumenrl_backends.engines.attention import packed_decode_attention

    fp8_out, pdl = self.__dict__.get(_FP8_OUT_ATTR), self.__dict__.get(_PDL_ATTR, False)
    folded = None  # rope_in_attention: q/k norm + RoPE + KV write inside the attention kernel
    if self.__dict__.get(_FOLD_ATTR) and attention is packed_decode_attention:
        from lumenrl_backends.engines.triton_rope_attention import fold_for_engine

        folded = fold_for_engine(self, cache, query, key, value, position_embeddings, attention_mask, fp8_out, pdl)
    if folded is not None:
        (out, v_scale), weights = folded, None
    else:
        written = _decode_qk_rope(self, cache, query, key, value, position_embeddings) if self.__dict__.get(
            _QK_ROPE_ATTR) else None
        if written is not None:
            query, key, value = written
        else:
            if hasattr(self, "q_norm"):  # Qwen3 / Qwen3-MoE: RMSNorm over the head dim before RoPE
                query, key = self.q_norm(query), self.k_norm(key)
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            cos, sin = position_embeddings
            query, key = family.apply_rotary_pos_emb(query, key, cos, sin)
            key, value = cache.update(key, value, self.layer_idx)
        window = self._lumenrl_window
        if window == "self":
            kwargs["sliding_window"] = self.sliding_window
        elif window == "config":
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
        if attention is packed_decode_attention:
            kwargs.update({"lumenrl_fp8_out": fp8_out} if fp8_out is not None else {})
            kwargs.update({"lumenrl_pdl": True} if pdl else {})
        out, weights = attention(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )
        v_scale = cache.current_scales.v_scale if out.dtype == fp8_out else None
    out = out.reshape(*input_shape, -1).contiguous()
    if v_scale is not None:  # codes in V's units over the FP8 cache: its V scale is their static scale
        a_scale = v_scale.float().reshape(1, 1).expand(out.shape[:-1].numel(), 1)
        return self.o_proj.forward_quantized(out.reshape(-1, out.shape[-1]), a_scale, hidden_states.dtype).reshape(
            *input_shape, -1), weights
    if decode is not None and decode.second and type(self.o_proj) is nn.Linear:  # not wrapped since fusion
        o_proj = self.o_proj
        out = _decode_linear(out.reshape(rows, -1), o_proj.weight, o_proj.bias, decode, second=True,
                             residual=None if residual is None else residual.reshape(rows, -1))
        return out.reshape(*input_shape, -1), weights
    return self.o_proj(out), weights


def _decode_qk_rope(
    self: nn.Module, cache: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``fused_qk_rope``: q/k norms, RoPE and the KV-cache write of a decode step as one op. query
    (b, q, H, D), key/value (b, q, H_kv, D) (q = 1: a decode step; q > 1: speculative decoding's verify
    forward, q columns per row) -> (query (b, H, q, D), key, value as ``cache.update`` returns them), or
    None where the HF sequence runs instead (see the module doc)."""
    from lumenrl_backends.engines.triton_rope import decode_qk_rope_kv_write

    batch, q_len, _, dim = query.shape
    view = getattr(cache, "view", None)
    if view is not None and view.rope is not None:  # the engine's once-per-step tables (CacheView.rope)
        position_embeddings = view.rope
    if position_embeddings is None or value.shape[-1] != dim:
        return None
    cos, sin = position_embeddings
    if cos.shape != (batch, q_len, dim) or sin.shape != cos.shape or cos.dtype != query.dtype or sin.dtype != cos.dtype:
        return None
    norms = (self.q_norm, self.k_norm) if hasattr(self, "q_norm") else None
    if norms is not None and (norms[0].weight.dtype != query.dtype or norms[1].weight.dtype != query.dtype):
        return None
    target = cache.decode_write_target(self.layer_idx, key.transpose(1, 2), value.transpose(1, 2))
    if target is None:
        return None
    query = decode_qk_rope_kv_write(
        query, key, value, cos, sin, target.keys, target.values, target.columns,
        q_weight=None if norms is None else norms[0].weight, k_weight=None if norms is None else norms[1].weight,
        eps=1e-6 if norms is None else norms[0].variance_epsilon, k_scale=target.k_scale, v_scale=target.v_scale,
        pdl=self.__dict__.get(_PDL_ATTR, False))
    return (query, *cache.decode_read(self.layer_idx))


def _mlp_forward(
    self: nn.Module, x: torch.Tensor, lumenrl_prequantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    lumenrl_norm: tuple[torch.Tensor, float] | None = None, lumenrl_residual: torch.Tensor | None = None,
) -> torch.Tensor:
    if torch.is_grad_enabled():  # training: the original forward on the member views (gradients flow)
        return self._lumenrl_original_forward(x)
    fused = getattr(self, _FUSED_ATTR)
    mode = self.__dict__.get(_SWIGLU_ATTR)  # every M (prefill too): one numerics for decode, prefill and rescoring
    if mode == "group":
        from lumenrl_quant.fused_mlp import swiglu_mlp_fp8

        return swiglu_mlp_fp8(x, fused.linear, self.down_proj)
    if mode == "token":
        from lumenrl_quant.fused_mlp import swiglu_mlp_fp8_tokenwise

        return swiglu_mlp_fp8_tokenwise(x, fused.linear, self.down_proj, x_quantized=lumenrl_prequantized)
    decode = self.__dict__.get(_DECODE_ATTR)  # the op picks kernel or cuBLAS by the row count (no guard here)
    if (lumenrl_norm is not None or lumenrl_residual is not None) and not _both_decode(decode, self.down_proj, mode):
        raise RuntimeError(f"{type(self).__name__}: a fused norm or residual needs gate/up and down on the decode kernel")
    if decode is not None:
        rows = x.shape[:-1].numel()
        x2 = x.reshape(rows, -1)
        if decode.first:  # gate/up GEMM with silu(gate) * up in its epilogue
            h = _decode_linear(x2, fused.weight, fused.bias, decode, swiglu=True, norm=lumenrl_norm)
        else:
            gate, up = fused(x2)
            h = self.act_fn(gate) * up
        down = self.down_proj
        plain = decode.second and type(down) is nn.Linear  # not wrapped since fusion
        residual = None if lumenrl_residual is None else lumenrl_residual.reshape(rows, -1)
        out = _decode_linear(h, down.weight, down.bias, decode, second=True, residual=residual) if plain else down(h)
        return out.reshape(*x.shape[:-1], -1)
    gate, up = fused(x)
    return self.down_proj(self.act_fn(gate) * up)


@dataclass(frozen=True, slots=True)
class _DecodeLinears:
    """Which of a module's two decode GEMMs run :func:`~lumenrl_backends.engines.triton_linear.decode_linear`
    (attention: q/k/v, o; MLP: gate/up with the SwiGLU epilogue, down), from how many rows (``auto``: the rows the
    shapes were measured at, ``triton_linear.auto_rows``; ``on``: 1..128) and whether they launch with PDL."""

    first: bool
    second: bool
    pdl: bool
    min_m: int  # rows the kernel takes: min_m..max_m (auto: triton_linear.auto_rows, on: 1..MAX_M)
    max_m: int
    prefetch: tuple[int, int]  # with pdl: weight columns of each row prefetched to L2 before the wait (first, second)
    tma: bool = False  # tiles copied by the tensor memory accelerator (KernelOptions.tma)


def _both_decode(decode: _DecodeLinears | None, second: nn.Module, other_path: Any) -> bool:
    """Whether a module's two GEMMs both run the decode op (where fused_norm's norm and residual go)."""
    return other_path is None and decode is not None and decode.first and decode.second and type(second) is nn.Linear


def _decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, decode: _DecodeLinears,
                   swiglu: bool = False, second: bool = False, norm: tuple[torch.Tensor, float] | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    from lumenrl_backends.engines.triton_linear import decode_linear

    return decode_linear(x, weight, bias, swiglu=swiglu, pdl=decode.pdl, prefetch=decode.prefetch[1 if second else 0],
                         min_m=decode.min_m, max_m=decode.max_m, norm_weight=None if norm is None else norm[0],
                         eps=1e-6 if norm is None else norm[1], residual=residual, tma=decode.tma)


def _swiglu_fp8_reason(module: nn.Module, fused: Any, tokenwise: bool = False) -> str | None:
    """None when the MLP can run lumenrl-quant's fused FP8 SwiGLU (``tokenwise``: its per-token
    variant), else why not."""
    if not isinstance(fused, _FusedQuantized):
        return "not quantized"
    if type(module.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(module.act_fn).__name__} is not SiLU"
    from lumenrl_quant.fused_mlp import swiglu_mlp_fp8_supported

    return swiglu_mlp_fp8_supported(fused.linear, module.down_proj, tokenwise=tokenwise)


_SUBCLASSES: dict[type, type] = {}


def _fused_class(cls: type, forward: Any) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                       "_lumenrl_original_forward": cls.forward})
    return _SUBCLASSES[cls]


def _cache_kwarg(cls: type) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


# kind -> (member projections, other attributes the fused forward needs, the fused forward)
_GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...], Any]] = {
    "attention": (("q_proj", "k_proj", "v_proj"), ("head_dim",), _attention_forward),
    "mlp": (("gate_proj", "up_proj"), ("down_proj", "act_fn"), _mlp_forward),
}
_ATTENTION_ATTRS = ("_lumenrl_family", "_lumenrl_window", "_lumenrl_cache_kwarg")
_FP8_OUT_ATTR = "_lumenrl_fp8_out"  # instance attribute: the o_proj's FP8 dtype when decode attention hands it codes
_QK_ROPE_ATTR = "_lumenrl_qk_rope"  # instance attribute: True when decode runs q/k norm + RoPE + KV write as one op
_DECODE_ATTR = "_lumenrl_decode_linear"  # instance attribute: a _DecodeLinears, or None (cuBLAS for every M)
_FOLD_ATTR = "_lumenrl_rope_in_attention"  # instance attribute: decode q/k norm + RoPE + KV write inside attention
_PDL_ATTR = "_lumenrl_pdl"  # instance attribute (attention): the decode RoPE and attention kernels launch with PDL


@torch.no_grad()
def fuse_projections(
    model: nn.Module, *, attention: bool = True, mlp: bool = True, fp8_mlp: bool = False, fp8_act_kernel: bool = True,
    fp8_attn_out: bool = True, fp8_norm_quant: bool = True, fused_qk_rope: bool = True, decode_linear: str = "off",
    pdl: bool = False, pdl_prefetch: int | tuple[int | None, int | None] | None = None, fused_norm: bool = False,
    rope_in_attention: bool = False, tma: bool = False,
) -> FusionReport:
    """Fuse q/k/v and gate/up projections of ``model`` in place (see module doc); returns a report.

    ``fp8_mlp`` (opt-in): ``fp8_row`` SwiGLU MLPs run :func:`lumenrl_quant.fused_mlp.swiglu_mlp_fp8`
    (SiLU * up and the down projection's input quantization in the gate/up GEMM's epilogue, 1 x 128
    group scales, every M); off keeps the per-token quantization between separate kernels. Three
    fewer kernels per layer but a slower group-scaled down GEMM: no faster decode on the GPU
    (benchmarks/RESULTS.md, entry ``fused_mlp``); hence not the default.

    ``fp8_act_kernel`` (default on; when ``fp8_mlp`` is off or does not apply): ``fp8_row`` SwiGLU MLPs
    keep per-token scales and both GEMMs, and SiLU * up with the down input's quantization runs as one
    kernel (:func:`lumenrl_quant.fused_mlp.swiglu_mlp_fp8_tokenwise`) instead of three inductor kernels.

    ``fp8_attn_out`` (default on): attentions whose ``o_proj`` is an ``fp8_row`` layer ask the engine's
    decode attention for FP8 codes when the KV cache is FP8 with one V scale per layer
    (:func:`~lumenrl_backends.engines.triton_attention.gqa_decode_attention_fp8`): the output is a
    convex combination of V codes, so the V scale is a static scale for it, and the per-token amax
    and cast kernel before ``o_proj`` disappear. Elsewhere (bf16 cache, prefill) nothing changes.

    ``fp8_norm_quant`` (default on): decoder layers whose attention and MLP both take per-token FP8
    input (``fp8_row``, the MLP on the per-token path) run their RMSNorms as
    :func:`lumenrl_quant.rmsnorm_quantize_fp8`, which hands the consumer its FP8 codes and scales.

    ``rope_in_attention`` (experiment, measured slower; with ``fused_qk_rope``): that op's work runs inside the
    decode attention kernel (:mod:`~lumenrl_backends.engines.triton_rope_attention`; ``attention_rope_folded``).

    ``fused_norm`` (experiment, measured slower): decoder layers whose four decode GEMMs all run the Triton decode kernel take
    their RMSNorms into the q/k/v and gate/up GEMMs and their residual adds into the o and down GEMMs
    (:mod:`~lumenrl_backends.engines.fused_layers`); ``layers_fused_norm_skipped`` says where not and why.

    ``fused_qk_rope`` (default on): attentions run their decode step's q/k norms,
    RoPE and KV-cache write as one op (:mod:`~lumenrl_backends.engines.triton_rope`), where the
    module's norms and its family's RoPE compute what the op computes (else ``attention_fused_rope_skipped``
    says why not).

    ``decode_linear`` (``off`` here; the engine passes its option on CUDA): decode-sized GEMMs (M <= 128 rows)
    of plain 16-bit layers run :func:`~lumenrl_backends.engines.triton_linear.decode_linear`: q/k/v and o
    in attention, gate/up with ``silu(gate) * up`` in its epilogue and down in the MLP; ``auto`` only where
    the shape has measured launch parameters for the device, ``on`` wherever the kernel takes the weight
    (``decode_linear_skipped`` says where not and why); ``pdl``: they, and the attentions' decode RoPE
    and attention kernels, launch with programmatic dependent launch (CUDA sm90+,
    :mod:`~lumenrl_backends.engines.triton_pdl`); ``tma``: those GEMMs copy their tiles with the tensor memory
    accelerator (sm90+; the same bits).

    Call after the model is on its device (and after quantization, if any): the fused storage is
    allocated where the members live, and later ``.to()`` calls would not move it.
    """
    if decode_linear not in ("auto", "on", "off"):
        raise ValueError(f"decode_linear={decode_linear!r}; allowed: auto, on, off")
    from lumenrl_backends.engines.fused_layers import DECODER_CLASSES, layer_forward, set_layer_fusion

    report = FusionReport()
    for name, module in list(model.named_modules()):
        cls = type(module)
        if cls in _SUBCLASSES.values() and cls.forward is layer_forward:
            continue  # decoder layers: below, once their attention and MLP are settled
        if cls in _SUBCLASSES.values():  # fused by an earlier engine on the same model: keep it
            (report.attention if cls.forward is _attention_forward else report.mlp).append(name)
            if cls.forward is _mlp_forward:
                _set_swiglu(module, name, fp8_mlp, fp8_act_kernel, report)
            else:
                _set_fp8_out(module, name, fp8_attn_out, report)
                _set_qk_rope(module, name, fused_qk_rope, report, rope_in_attention)
                module.__dict__[_PDL_ATTR] = pdl
            _set_decode_linear(module, name, "mlp" if cls.forward is _mlp_forward else "attention", decode_linear,
                               pdl, report, pdl_prefetch, tma)
            continue
        kind = ("attention" if attention and cls.__name__ in ATTENTION_CLASSES
                else "mlp" if mlp and cls.__name__ in MLP_CLASSES else None)
        if kind is None:
            continue
        projections, needed, forward = _GROUPS[kind]
        parts = [getattr(module, p, None) for p in projections]
        if any(p is None for p in parts) or not all(hasattr(module, a) for a in needed):
            report.skipped[name] = f"no {'/'.join(projections + needed)}"
            continue
        fused = _fuse_group(parts)
        if isinstance(fused, str):
            report.skipped[name] = fused
            continue
        module.__dict__[_FUSED_ATTR] = fused
        if kind == "attention":  # what _attention_forward reads besides the fused linear
            module.__dict__.update(zip(_ATTENTION_ATTRS, (
                _family_module(cls), ATTENTION_CLASSES[cls.__name__], _cache_kwarg(cls))))
        module.__class__ = _fused_class(cls, forward)
        getattr(report, kind).append(name)
        if kind == "mlp":
            _set_swiglu(module, name, fp8_mlp, fp8_act_kernel, report)
        else:
            _set_fp8_out(module, name, fp8_attn_out, report)
            _set_qk_rope(module, name, fused_qk_rope, report, rope_in_attention)
            module.__dict__[_PDL_ATTR] = pdl
        _set_decode_linear(module, name, kind, decode_linear, pdl, report, pdl_prefetch, tma)
    for name, module in model.named_modules():
        if type(module).__name__ in DECODER_CLASSES:
            set_layer_fusion(module, name, fp8_norm=fp8_norm_quant and attention and mlp,
                             norm_gemm=fused_norm and attention and mlp, report=report)
    return report


def _set_fp8_out(module: nn.Module, name: str, wanted: bool, report: FusionReport) -> None:
    o_proj = getattr(module, "o_proj", None)
    ok = wanted and getattr(o_proj, "scheme", None) == "fp8_row" and hasattr(o_proj, "forward_quantized")
    module.__dict__[_FP8_OUT_ATTR] = o_proj.fp8_dtype if ok else None
    if ok:
        report.attention_fp8_out.append(name)


def _set_qk_rope(module: nn.Module, name: str, wanted: bool, report: FusionReport, fold: bool = False) -> None:
    from lumenrl_backends.engines.triton_rope import hf_mismatch

    reason = hf_mismatch(module._lumenrl_family.apply_rotary_pos_emb, getattr(module, "q_norm", None),
                         getattr(module, "k_norm", None), module.head_dim) if wanted else "off"
    module.__dict__[_QK_ROPE_ATTR] = reason is None
    module.__dict__[_FOLD_ATTR] = fold and reason is None  # the fold computes what the fused op computes
    if reason is None:
        report.attention_fused_rope.append(name)
        if fold:
            report.attention_rope_folded.append(name)
    elif reason != "off":
        report.attention_fused_rope_skipped[name] = reason


def _set_decode_linear(module: nn.Module, name: str, kind: str, mode: str, pdl: bool, report: FusionReport,
                       prefetch_bytes: int | tuple[int | None, int | None] | None = None, tma: bool = False) -> None:
    """Route the module's decode GEMMs (M <= 128 rows) to the Triton decode kernel where it takes the weights:
    plain (unquantized) 16-bit weights of the tile's multiples; the MLP's gate/up only with a SiLU
    activation (its epilogue is SwiGLU) and not on a lumenrl-quant FP8 SwiGLU path; ``mode`` ``auto`` only
    shapes with measured launch parameters (``triton_linear.TUNED``), ``on`` every such weight."""
    from functools import partial

    from lumenrl_backends.engines import triton_linear

    module.__dict__[_DECODE_ATTR] = None
    if mode == "off":
        return
    weight_reason = partial(triton_linear.weight_reason, tuned_only=mode == "auto")
    fused = module.__dict__[_FUSED_ATTR]
    second = module.o_proj if kind == "attention" else module.down_proj
    if kind == "attention":
        first_reason = weight_reason(fused.weight, fused.bias) if isinstance(fused, _FusedDense) else "quantized"
    elif module.__dict__.get(_SWIGLU_ATTR) is not None or not isinstance(fused, _FusedDense):
        first_reason = "quantized"
    elif type(module.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        first_reason = f"activation {type(module.act_fn).__name__} is not SiLU"
    else:
        first_reason = weight_reason(fused.weight, fused.bias, swiglu=True)
    second_reason = (weight_reason(second.weight, second.bias) if type(second) is nn.Linear
                     else f"{type(second).__name__} is not a plain nn.Linear")
    if first_reason is None or second_reason is None:
        pair = prefetch_bytes if isinstance(prefetch_bytes, tuple) else (prefetch_bytes, prefetch_bytes)
        prefetch = tuple(triton_linear.PDL_PREFETCH if b is None else b // 2 for b in pair)  # 16-bit weight columns
        swiglu = kind != "attention"  # auto: the rows the routed shapes were measured at (both: those common)
        ranges = [triton_linear.auto_rows(fused.weight.shape[0] // (1 + swiglu), fused.weight.shape[1], swiglu=swiglu)
                  ] * (first_reason is None) + [triton_linear.auto_rows(*second.weight.shape)] * (second_reason is None)
        rows = (max(r[0] for r in ranges), min(r[1] for r in ranges)) if mode == "auto" else (1, triton_linear.MAX_M)
        module.__dict__[_DECODE_ATTR] = _DecodeLinears(first_reason is None, second_reason is None, pdl, *rows,
                                                       prefetch=prefetch, tma=tma)
        report.decode_linear.append(name)
    if first_reason is not None or second_reason is not None:
        report.decode_linear_skipped[name] = "; ".join(r for r in (first_reason, second_reason) if r is not None)


def _set_swiglu(module: nn.Module, name: str, group: bool, token: bool, report: FusionReport) -> None:
    fused = module.__dict__[_FUSED_ATTR]
    reason = _swiglu_fp8_reason(module, fused) if group else "off"
    mode = "group" if reason is None else None
    if reason is None:
        report.mlp_fp8.append(name)
    elif reason not in ("off", "not quantized"):
        report.mlp_fp8_skipped[name] = reason
    if mode is None and token and _swiglu_fp8_reason(module, fused, tokenwise=True) is None:
        mode = "token"
        report.mlp_fp8_token.append(name)
    module.__dict__[_SWIGLU_ATTR] = mode


def rope_tables(model: nn.Module, report: FusionReport | None, options: dict | None) -> Any | None:
    """``tables(positions (b, 1)) -> (cos, sin)``: the decode step's RoPE, compiled, for the engine to compute
    once per step (``CacheView.rope``), or None where the fused RoPE op does not run or the layers might not all
    take the model's one rotary embedding (none, or several rotary modules: local and global RoPE).

    Why: under ``torch.compile`` each call of the opaque fused op realizes its own copy of the forward's
    cos/sin (inductor copies a pointwise input of an extern kernel per consumer), in kernels of four layers
    each (nine per step at 36 layers). Tables computed before the forward reach every layer as graph inputs.
    Same values: the model's own rotary module, traced the same way."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    rotaries = [m for m in model.modules() if "RotaryEmbedding" in type(m).__name__]
    if report is None or not report.attention_fused_rope or rotary is None or rotaries != [rotary]:
        return None
    parameter = next(model.parameters())
    probe = torch.empty(0, dtype=parameter.dtype, device=parameter.device)  # the rotary reads x's dtype and device

    def tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(probe, positions)

    return torch.compile(tables, options=options)


def unfuse_projections(model: nn.Module) -> int:
    """Restore the original forwards of fused modules (the members stay views of the fused
    storage, with the same values); returns how many modules were restored."""
    originals = {fused: base for base, fused in _SUBCLASSES.items()}
    count = 0
    for module in model.modules():
        base = originals.get(type(module))
        if base is None:
            continue
        module.__class__ = base
        for attr in (_FUSED_ATTR, _SWIGLU_ATTR, _FP8_OUT_ATTR, _QK_ROPE_ATTR, _FOLD_ATTR, "_lumenrl_layer_mode", _DECODE_ATTR, _PDL_ATTR,
                     "_lumenrl_layer_cache_kwarg",
                     *_ATTENTION_ATTRS):
            module.__dict__.pop(attr, None)
        count += 1
    return count
