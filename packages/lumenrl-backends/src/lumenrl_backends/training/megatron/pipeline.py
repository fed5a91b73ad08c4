"""Pipeline parallel micro-batches through Megatron-Core's schedule (pp > 1, CUDA).

:func:`run_pipeline` hands the micro-batches of one mini-batch (or one inference slice) to
``get_forward_backward_func()`` (non-interleaved 1F1B): every stage runs
:meth:`~.model.MegatronCausalLM.stage_forward` on each micro-batch (a stage after the first reads
the previous stage's hidden states, exchanged with their shapes first: ``variable_seq_lengths``,
micro-batches may differ in rows and columns); on the last stage ``on_logits(i, logits)`` turns
micro-batch i's logits (b, s, V/tp) into ``(loss, result)``. The loss is back-propagated as given
(``calculate_per_token_loss``: no division by the number of micro-batches; the backend's losses
are already normalized over the mini-batch). Results come back on the last stage, in micro-batch
order; other stages get an empty list (:func:`from_last_stage` sends objects to them).
Gradients are not reduced here: the backend's ``finalize_grads`` runs after the schedule.

Megatron-Core 0.16's schedule allocates on CUDA (``torch.zeros([], device="cuda")``, P2P receive
buffers on ``torch.cuda.current_device()``), so pp > 1 is refused on CPU at build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lumenrl_backends.training.megatron.parallel import ParallelGroups

__all__ = ["from_last_stage", "run_pipeline"]


def run_pipeline(
    model: Any,
    micros: Sequence[Mapping[str, torch.Tensor]],
    on_logits: Callable[[int, torch.Tensor], tuple[torch.Tensor, Any]],
    *,
    forward_only: bool,
) -> list[Any]:
    """Megatron's schedule over ``micros`` (each with ``input_ids`` and ``attention_mask`` (b, s));
    returns ``on_logits``'s results on the last stage, ``[]`` elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, _gpt):
        i = next(data_iterator)
        output = model.stage_forward(micros[i]["input_ids"], micros[i]["attention_mask"])

        def loss_func(logits: torch.Tensor):
            loss, result = on_logits(i, logits)
            return loss, torch.ones((), dtype=torch.int, device=loss.device), result

        return output, loss_func

    rows, cols = micros[0]["input_ids"].shape
    return list(get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(range(len(micros))),
        model=[model.gpt],
        num_microbatches=len(micros),
        seq_length=cols,
        micro_batch_size=rows,
        forward_only=forward_only,
    ))


def from_last_stage(value: Any, groups: ParallelGroups) -> Any:
    """``value`` of the last pipeline stage, on every stage (a pickled object broadcast)."""
    box = [value if groups.last_stage else None]
    dist.broadcast_object_list(box, src=groups.stage_rank(groups.pp - 1), group=groups.pp_group)
    return box[0]
