"""Model-side helpers for the training backends.

- :class:`CriticModel`: a decoder backbone (the ``.model`` of an HF causal LM, so parameter
  names stay ``model.layers.N...`` as in the HF checkpoint) plus a scalar ``value_head``
  (``nn.Linear(hidden, 1)``) on the last hidden state. The LM head is dropped.
- :func:`set_training`: ``model.train(mode)`` unless the model is already in that mode.
- :func:`response_logits`: logits for the T response positions of a (B, P+T) sequence.
- :func:`token_log_probs`: ``log_softmax(logits.float() / temperature)`` gathered at the
  response tokens (as ``z_tok - logsumexp(z)``, without a (B, T, V) log-prob tensor), plus the
  entropy of that same processed distribution, ``logsumexp(z) - sum_v softmax(z)_v z_v``
  (compiled: the fused autograd function of :mod:`~lumenrl_backends.training.logprobs`).
"""

from __future__ import annotations

import torch
from torch import nn

from lumenrl_backends.training.logprobs import fused_token_log_probs

__all__ = [
    "LAYER_INDUCTOR_OPTIONS",
    "CriticModel",
    "compile_decoder_layers",
    "decoder_layers",
    "enable_activation_checkpointing",
    "layer_inductor_options",
    "response_logits",
    "set_training",
    "token_log_probs",
]


def set_training(model: nn.Module, training: bool) -> None:
    """``model.train(training)``, skipped when the model is already in that mode: the call walks every module
    (hundreds in a 28-layer model, milliseconds of host time per call), and a backend switches its model at
    every log-prob and update call. The root's flag stands for all: the backends set their models' modes only
    through this function."""
    if model.training != training:
        model.train(training)


class CriticModel(nn.Module):
    """``values = value_head(backbone(input_ids).last_hidden_state)``, shape (B, L)."""

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        self.config = causal_lm.config
        self.model = causal_lm.model  # the decoder stack without lm_head
        self.value_head = nn.Linear(self.config.hidden_size, 1, bias=True)
        with torch.no_grad():  # small init: initial values near 0 (returns are O(1) rewards)
            self.value_head.weight.normal_(0.0, 1.0 / (self.config.hidden_size + 1))
            self.value_head.bias.zero_()

    def activation_checkpointing_enable(self) -> None:
        enable_activation_checkpointing(self.model)

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state  # (B, L, H)
        head = self.value_head
        return (hidden.to(head.weight.dtype) @ head.weight[0] + head.bias[0]).float()  # (B, L), not a view


def enable_activation_checkpointing(model: nn.Module) -> None:
    """HF activation (gradient) checkpointing, non-reentrant, under either transformers API name."""
    if isinstance(model, CriticModel):
        model.activation_checkpointing_enable()
    elif hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# Inductor options of the compiled decoder layers (decision 0006). No mix-order reduction: each RMSNorm
# backward's weight gradient is a reduction kernel of its own, not per-split partial sums that the generated
# wrapper then adds up with an ATen sum (4 per layer); the 1.7B step took 0.3-1.1 ms less in 4 of 4 pairs.
LAYER_INDUCTOR_OPTIONS: dict[str, object] = {"triton.mix_order_reduction": False}


def layer_inductor_options() -> dict[str, object]:
    """:data:`LAYER_INDUCTOR_OPTIONS` less the keys this torch's Inductor does not have (an older release)."""
    import torch._inductor.config as inductor_config

    def known(key: str) -> bool:
        node = inductor_config
        for part in key.split("."):
            if not hasattr(node, part):
                return False
            node = getattr(node, part)
        return True

    return {k: v for k, v in LAYER_INDUCTOR_OPTIONS.items() if known(k)}


def compile_decoder_layers(model: nn.Module, backend: bool | str) -> None:
    """``nn.Module.compile`` on every decoder layer (in place: parameter names do not change).

    Identical layers share one compiled graph; the recompile limit is raised so that per-layer
    guards never push a layer back to eager. FSDP2's hooks stay eager (dynamo skips them).
    Under Inductor (``True`` or ``"inductor"``) the layers compile with :func:`layer_inductor_options`.
    Shapes: static at first, and at the first new length once more with the length symbolic (dynamo's automatic
    dynamic shapes), so RL batches, whose lengths change every step, reuse that graph; compiled static per length
    they recompiled at every step until the recompile limit left the layers eager. A run of one shape (the
    ``train`` benchmark) compiles static only, as before.
    """
    import torch._dynamo

    layers = decoder_layers(model)
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 2 * len(layers) + 8))
    kwargs: dict[str, object] = {} if backend is True else {"backend": backend}
    options = layer_inductor_options() if backend in (True, "inductor") else {}
    if options:
        kwargs["options"] = options
    for layer in layers:
        layer.compile(dynamic=None, **kwargs)  # automatic dynamic (docstring)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks of an HF model (``model.layers`` or ``model.model.layers``; a
    peft-wrapped model is unwrapped first)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"model of type {type(model).__name__} has no .model.layers; cannot shard per layer")
    return list(layers)


def response_logits(
    model: nn.Module, input_ids, attention_mask, position_ids, response_len: int
) -> torch.Tensor:
    """Logits predicting the last ``response_len`` tokens: (B, T, V).

    Position i of the sequence predicts token i+1, so the response tokens (the last T
    positions) are predicted by positions [L-T-1, L-1): exactly those go through the LM head
    (``logits_to_keep`` as a 1-D index tensor), so no (B, T+1, V) logits tensor is sliced (its
    backward would write a zero-filled full-size gradient and copy into it).
    """
    L = input_ids.shape[1]
    keep = torch.arange(L - response_len - 1, L - 1, device=input_ids.device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=keep,
        use_cache=False,
    )
    return out.logits  # (B, T, V)


def token_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    *,
    compile_backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log p(token) under ``softmax(logits / temperature)`` and optionally its entropy.

    ``compile_backend="lumenrl_exact"`` (``policy.rollout.exact_logprobs``): log-probs by the engine's
    batch-invariant log-softmax (:func:`~lumenrl_backends.exact.exact_token_log_probs`); entropy as below.

    ``compile_backend`` (e.g. ``"inductor"``): the fused forward/backward of
    :mod:`~lumenrl_backends.training.logprobs` as torch.compile'd kernels (no (B, T, V) float32
    tensor kept for autograd). None: the plain autograd formula below (measured faster in eager
    mode than the eager fused chunks on H200: 23.2k vs 21.3k tokens/s at 1.7B).
    """
    if compile_backend == "lumenrl_exact":
        from lumenrl_backends.exact import exact_token_log_probs

        entropy = token_log_probs(logits, tokens, temperature, True)[1] if with_entropy else None
        return exact_token_log_probs(logits, tokens, temperature), entropy
    if compile_backend is not None:
        return fused_token_log_probs(logits, tokens, temperature, with_entropy, compile_backend=compile_backend)
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for log-probs")
    scaled = logits.float() / temperature  # (B, T, V)
    lse = torch.logsumexp(scaled, dim=-1)  # (B, T)
    log_probs = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse  # (B, T)
    entropy = None
    if with_entropy:  # H = lse - sum_v p_v * z_v, with p = softmax(z): one (B, T, V) temporary
        entropy = lse - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return log_probs, entropy
