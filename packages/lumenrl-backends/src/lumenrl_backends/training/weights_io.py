"""Weights, export and checkpoints of a training backend (the FSDP2 backend and those built on it).

:class:`BackendWeights` is mixed into :class:`~lumenrl_backends.training.fsdp2.FSDP2Backend`; it reads
the backend's ``model``, ``single`` (the single-device path's master mirror or None), ``role``,
``device``, ``is_critic``, ``optimizer`` and ``scheduler``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lumenrl_backends.training import checkpoint as ckpt
from lumenrl_backends.training import distributed as dist_utils
from lumenrl_backends.training.lora import adapter_writer, is_lora_model, merged_tensors
from lumenrl_backends.training.nonfinite import refuse_nonfinite
from lumenrl_backends.training.precision import write_hf

__all__ = ["BackendWeights", "full_tensor"]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class BackendWeights:
    # ----------------------------------------------------------------- weights and export

    @property
    def weights_module(self) -> nn.Module:
        """The module whose state dict holds the fp32 master weights under HF names (checkpoints,
        export): the sharded model, or the single-device path's master mirror."""
        return self.single.master_module if self.single is not None else self.model

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) fp32 master tensors with HF names, one at a time. Collective under torchrun."""
        for name, tensor in self.weights_module.state_dict().items():
            yield name, full_tensor(tensor).detach()

    @property
    def is_lora(self) -> bool:
        """True when the module carries LoRA adapters (``policy.lora.rank > 0``)."""
        return is_lora_model(self.model)

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """The full state dict on CPU (rank 0; other ranks get ``{}``). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.weights_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def _check_finite(self, what: str) -> None:  # collective: every rank refuses together
        refuse_nonfinite(self.weights_module.state_dict().items(), what, self.device)

    def save_hf(self, path: str, tokenizer: Any = None) -> None:
        """``save_pretrained`` of the full model into ``path`` (rank 0 writes). Collective.

        A critic saves its backbone in HF format plus ``value_head.safetensors``. A LoRA policy
        saves the merged model, and its adapter in peft's format under ``PATH/adapter``.
        """
        self._check_finite(f"the {self.role} export {path}")
        state = self.state_dict_for_export()
        if dist_utils.rank() == 0 and self.is_lora:
            write_hf(self.model.get_base_model(), dict(merged_tensors(self.model, state.items())), path, critic=False)
            adapter_writer(self.model, state)(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        elif dist_utils.rank() == 0:
            write_hf(self.model, state, path, critic=self.is_critic)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        dist_utils.barrier()

    # ----------------------------------------------------------------- checkpoints

    def save_checkpoint(self, path: str, *, extra: Mapping[str, Any] | None = None) -> None:
        """Model, optimizer, scheduler and RNG states (+ caller JSON ``extra``), written atomically.

        A LoRA policy's checkpoint also holds its adapter in peft's format (``PATH/adapter``).
        """
        self._check_finite(f"the {self.role} checkpoint {path}")
        files = adapter_writer(self.model, self.state_dict_for_export()) if self.is_lora else None
        ckpt.save_training_state(
            path,
            model=self.weights_module,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            extra=extra,
            files=files,
        )

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns its ``extra`` dict."""
        extra = ckpt.load_training_state(
            path, model=self.weights_module, optimizer=self.optimizer, scheduler=self.scheduler
        )
        if self.single is not None:  # restored fp32 master -> compute weights
            self.single.copy_back()
        return extra
