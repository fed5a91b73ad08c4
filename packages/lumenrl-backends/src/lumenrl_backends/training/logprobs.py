"""Fused, chunked token log-probs and entropy with a hand-written backward.

For logits ``x`` (N, V) (any float dtype), temperature ``t`` and target tokens ``y`` (N,):

    z = float32(x) / t,   lse = logsumexp(z),   p = exp(z - lse)
    log_prob = z[y] - lse
    entropy  = lse - sum_v p_v z_v

(evaluated on zc = z - max(z), so that no large terms cancel; lse is saved for backward).

Backward (g_lp, g_H the incoming gradients of log_prob and entropy):

    d log_prob / dz = onehot(y) - p
    d entropy  / dz = -p * (z - (lse - H))        (since sum_v p_v z_v = lse - H)
    dx = (g_lp * (onehot(y) - p) - g_H * p * (z - lse + H)) / t     cast to x's dtype

Chunks: eager mode works on row chunks of at most 128M elements in float32 (bounded
temporaries); with ``compile_backend`` the two chunk functions are torch.compile'd and run once
over the whole tensor (inductor fuses upcast, scaling, the reductions and the gradient into a few
passes that read the bf16 logits and write the bf16 gradient, nothing else); ``"triton"``: the
one-pass kernels of :mod:`.triton_logprobs` (the default of a compiled training step on CUDA:
inductor's forward reads the logits three times).

Why: the autograd graph of the plain formula keeps several (N, V) float32 tensors alive (the
upcast, the scaled logits, the softmax) and runs ~10 passes over them; at RL shapes (N = 8k
tokens, V = 152k) that is ~5 GB each. Here only ``x`` itself (already alive), ``lse`` and ``H``
are saved; forward and backward work on row chunks of ``chunk_rows`` in float32 and write one
(N, V) gradient in ``x``'s dtype. Same values as the plain formula up to float32 rounding.
"""

from __future__ import annotations

import torch

from lumenrl_backends.training import triton_logprobs

__all__ = ["fused_token_log_probs", "logprob_backend"]

_CHUNK_ELEMENTS = 1 << 27  # 128M float32 elements (512 MB) of temporaries per chunk


def _chunks(logits: torch.Tensor):
    """(b, rows) index pairs covering a (B, T, V) tensor whose (T, V) slabs are contiguous."""
    batch, rows, vocab = logits.shape
    step = max(1, min(rows, _CHUNK_ELEMENTS // max(vocab, 1)))
    for b in range(batch):
        for s in range(0, rows, step):
            yield b, slice(s, min(s + step, rows))


def _forward_chunk(x: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
    """(lse, log_prob, entropy-or-None) of x (..., V) in float32."""
    z = x.float() / temperature
    m = z.amax(dim=-1, keepdim=True)
    zc = z - m  # <= 0: keeps lse_c in [0, log V], so lse_c - sum(p zc) does not cancel large terms
    lse_c = torch.logsumexp(zc, dim=-1)
    log_probs = zc.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse_c
    lse = lse_c + m.squeeze(-1)
    if not with_entropy:
        return lse, log_probs, None
    return lse, log_probs, lse_c - (torch.exp(zc - lse_c.unsqueeze(-1)) * zc).sum(-1)


def _backward_chunk(x, tokens, lse, entropy, g_lp, g_ent, temperature: float):
    """dx = (g_lp (onehot - p) - g_H p (z - lse + H)) / t, in x's dtype (g_ent may be None)."""
    z = x.float() / temperature
    lse, g_lp = lse.unsqueeze(-1), g_lp.unsqueeze(-1).float()
    p = torch.exp(z - lse)
    onehot = torch.arange(x.shape[-1], device=x.device) == tokens.unsqueeze(-1)
    dz = g_lp * (onehot.to(z.dtype) - p)
    if g_ent is not None:
        dz = dz - g_ent.unsqueeze(-1).float() * p * (z - lse + entropy.unsqueeze(-1))
    return (dz / temperature).to(x.dtype)


_COMPILED: dict[str, tuple] = {}


def _kernels(backend: str | None):
    """(forward, backward) functions: eager chunk functions (None), the one-pass Triton kernels
    (``"triton"``), or the chunk functions torch.compile'd with ``backend``. All but eager run once over
    the whole tensor."""
    if backend is None:
        return _forward_chunk, _backward_chunk
    if backend == "triton":
        return triton_logprobs.token_log_probs_forward, triton_logprobs.token_log_probs_backward
    if backend not in _COMPILED:
        _COMPILED[backend] = (
            torch.compile(_forward_chunk, backend=backend, dynamic=None),
            torch.compile(_backward_chunk, backend=backend, dynamic=None),
        )
    return _COMPILED[backend]


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature: float, with_entropy: bool, backend: str | None):
        fwd, _ = _kernels(backend)  # logits (B, T, V), tokens (B, T)
        if backend is not None:  # one call over the whole tensor: its outputs are the results (no copy)
            lse, log_probs, entropy = fwd(logits, tokens, temperature, with_entropy)
            entropy = entropy if with_entropy else lse.new_empty(0)
        else:
            lse = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
            log_probs = torch.empty_like(lse)
            entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
            for b, sl in _chunks(logits):
                c_lse, c_lp, c_ent = fwd(logits[b, sl], tokens[b, sl], temperature, with_entropy)
                lse[b, sl], log_probs[b, sl] = c_lse, c_lp
                if with_entropy:
                    entropy[b, sl] = c_ent
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.with_entropy, ctx.backend = temperature, with_entropy, backend
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, tokens, lse, entropy = ctx.saved_tensors
        _, bwd = _kernels(ctx.backend)
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp
        use_ent = ctx.with_entropy and g_ent is not None
        if ctx.backend is not None:  # the kernel writes the (B, T, V) gradient itself: no copy of it
            grad = bwd(logits, tokens, lse, entropy if use_ent else None, g_lp, g_ent if use_ent else None,
                       ctx.temperature)
            return grad, None, None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for b, sl in _chunks(logits):
            grad[b, sl] = bwd(
                logits[b, sl], tokens[b, sl], lse[b, sl], entropy[b, sl] if use_ent else None,
                g_lp[b, sl], g_ent[b, sl] if use_ent else None, ctx.temperature,
            )
        return grad, None, None, None, None


def logprob_backend(device: torch.device, compile_layers: bool | str) -> str:
    """The fused log-prob kernels a compiled training step uses: the one-pass Triton kernels on CUDA
    (:mod:`.triton_logprobs`), else ``compile_layers``' torch.compile backend (``True``: inductor)."""
    if compile_layers is True and device.type == "cuda" and triton_logprobs.available():
        return "triton"
    return "inductor" if compile_layers is True else str(compile_layers)


def fused_token_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    *,
    compile_backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token) and entropy of ``softmax(float(logits) / temperature)``: logits (..., V) -> (...).

    ``logits`` may be a row-slice view such as ``out.logits[:, :-1]``: no copy is made as long as
    each (T, V) slab is contiguous. ``compile_backend`` (e.g. ``"inductor"``) runs forward and
    backward as torch.compile'd kernels over the whole tensor (one fused pass each, no float32
    temporaries); None runs eager float32 chunks.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for log-probs")
    shape = tokens.shape
    x, y = logits, tokens
    if x.dim() != 3:
        x, y = x.reshape(1, -1, x.shape[-1]), y.reshape(1, -1)
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    log_probs, entropy = _LogProbEntropy.apply(x, y.contiguous(), float(temperature), with_entropy, compile_backend)
    return log_probs.view(shape), (entropy.view(shape) if with_entropy else None)
