"""Export an Eagle3 draft in the layout vLLM and SGLang load, and load it back.

Directory: ``config.json`` + ``model.safetensors``.

config.json (a Llama config plus the Eagle3 keys the loaders read)::

    architectures ["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1,
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
    vocab_size (target), draft_vocab_size, target_hidden_size, rms_norm_eps, rope_theta,
    max_position_embeddings, hidden_act "silu", tie_word_embeddings false, torch_dtype,
    eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state: true}

``eagle_aux_hidden_state_layer_ids`` uses the serving engines' convention: id j is the hidden state
entering decoder layer j (the output of layer j - 1), so LumenRL's 0-based layer outputs [1, N/2-1, N-4]
are written as [2, N/2, N-3] (vLLM's default selection). The same ids are kept at top level too.

Tensors: ``fc.weight`` (H, 3H), ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v}_proj.weight`` (., 2H), ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` (Vd, H),
``embed_tokens.weight`` (V, H), ``d2t`` (Vd,) int64 offsets, ``t2d`` (V,) bool.
Facts and loader file paths: docs/decisions/0013-sddd.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lumenrl_sddd.eagle3 import Eagle3Config, Eagle3Draft

__all__ = ["export_eagle3", "load_eagle3", "save_draft", "load_draft", "EXPORT_TENSORS"]

EXPORT_TENSORS = (
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
    "embed_tokens.weight", "d2t", "t2d",
)


def export_eagle3(draft: Eagle3Draft, path: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    c = draft.config
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    serve_ids = [i + 1 for i in c.aux_layer_ids]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": serve_ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": serve_ids,
    }
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = draft.state_dict()
    tensors = {}
    for name in EXPORT_TENSORS:
        tensor = state[name].detach().cpu()
        tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor.contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def load_eagle3(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Eagle3Draft:
    source = Path(path)
    cfg = json.loads((source / "config.json").read_text())
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise ValueError(f"{source}: architectures={cfg.get('architectures')!r}, expected ['LlamaForCausalLMEagle3']")
    serve_ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    draft = Eagle3Draft(Eagle3Config(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], vocab_size=cfg["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"],
        aux_layer_ids=[i - 1 for i in serve_ids], rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"],
        max_position_embeddings=cfg["max_position_embeddings"]))
    tensors = load_file(str(source / "model.safetensors"))
    missing = [n for n in EXPORT_TENSORS if n not in tensors and n != "embed_tokens.weight"]
    if missing:
        raise ValueError(f"{source}: missing tensors {missing}")
    draft.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False)
    return draft.to(dtype)


def save_draft(draft: Any, path: str | Path) -> Path:
    """Eagle3: :func:`export_eagle3` in float32 (reloads bit-exactly); DFlash: config.json + model.safetensors."""
    if draft.kind == "eagle3":
        return export_eagle3(draft, path, dtype=torch.float32)
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({"architectures": ["LumenRLDFlashDraft"], **draft.config_dict()},
                                                   indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}, str(target / "model.safetensors"))
    return target


def load_draft(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Any:
    """Either kind of draft from a directory written by :func:`save_draft` / :func:`export_eagle3`."""
    source = Path(path)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: no config.json (expected an exported Eagle3 or DFlash draft directory)")
    cfg = json.loads((source / "config.json").read_text())
    if cfg.get("architectures") == ["LlamaForCausalLMEagle3"]:
        return load_eagle3(source, dtype=dtype)
    if cfg.get("kind") != "dflash":
        raise ValueError(f"{source}: config.json is neither an Eagle3 export nor a LumenRL DFlash draft")
    from lumenrl_sddd.dflash import DFlashConfig, DFlashDraft

    fields = {k: v for k, v in cfg.items() if k not in ("kind", "architectures")}
    draft = DFlashDraft(DFlashConfig(**fields))
    draft.load_state_dict(load_file(str(source / "model.safetensors")))
    return draft.to(dtype)
