"""Weight channel between process pools: training rank 0 -> every rollout replica (disaggregated).

Design
------
Disaggregated placement runs the rollout replicas in their own processes (own GPUs), outside the
training ranks' ``torch.distributed`` default group. A :class:`WeightChannel` is a separate,
stateless process group of ``1 + R`` members over its own ``TCPStore``: member 0 is training rank
0, members ``1..R`` the rollout replicas. It never touches the default group, so FSDP2 inside the
training pool is unaffected. Backend: gloo on CPU, NCCL on CUDA (``ProcessGroupNCCL`` built the
same way).

One sync: every training rank walks ``trainer_weights`` (the FSDP2 all-gathers are collective over
the training pool); rank 0 additionally broadcasts, per tensor, first a header (the pickled list
of ``(name, shape, dtype)`` of the next bucket, as a uint8 tensor with its length) and then the
bucket's tensors; receivers allocate each tensor from the header and hand every bucket to
``engine.update_weights`` (in place, see :mod:`.inprocess`). An empty header ends the stream.
Peak extra memory on either side is one bucket (``weight_sync.bucket_size_mb``).
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lumenrl_backends.sync.inprocess import trainer_weights

__all__ = ["WeightChannel"]

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.uint8, torch.int8, torch.bool)}


class WeightChannel:
    """Member ``rank`` of a ``size``-member broadcast group rooted at member 0 (training rank 0)."""

    def __init__(self, *, host: str, port: int, rank: int, size: int, device: torch.device,
                 timeout_s: float = 600.0) -> None:
        self.rank, self.size, self.device = rank, size, device
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))

    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast([tensor], dist.BroadcastOptions()).wait()
        return tensor

    def _header(self, items: list[tuple[str, torch.Tensor]] | None) -> list[tuple[str, tuple, str]]:
        """Member 0 sends the bucket's (name, shape, dtype) list; the others receive it."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            payload = pickle.dumps([(n, tuple(t.shape), str(t.dtype)) for n, t in items or []])
            length.fill_(len(payload))
        self._bcast(length)
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._bcast(buf)
        return pickle.loads(buf.cpu().numpy().tobytes()) if self.rank else []

    def send(self, source: Any, *, bucket_bytes: int) -> dict[str, float]:
        """Member 0 (training rank 0) streams ``source``'s weights; the other training ranks must
        walk :func:`trainer_weights` at the same time (its gathers are collective), see ``drain``."""
        start, sent, count = time.perf_counter(), 0, 0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0

        def flush() -> None:
            self._header(bucket)
            for _, t in bucket:
                self._bcast(t.to(self.device).contiguous())

        for name, tensor in trainer_weights(source, bucket_bytes=bucket_bytes):
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            sent += tensor.numel() * tensor.element_size()
            count += 1
            if size >= bucket_bytes:
                flush()
                bucket, size = [], 0
        if bucket:
            flush()
        self._header([])  # end of stream
        return {"weight_sync/tensors": float(count), "weight_sync/gb": sent / 1e9,
                "timing/sync_s": time.perf_counter() - start}

    @staticmethod
    def drain(source: Any, *, bucket_bytes: int) -> None:
        """Training ranks > 0: take part in the gathers of a sync that rank 0 sends."""
        for _ in trainer_weights(source, bucket_bytes=bucket_bytes):
            pass

    def receive(self, engine: Any, version: int) -> int:
        """Rollout side: receive buckets until the empty header, copying each into ``engine``."""
        count = 0
        while True:
            header = self._header(None)
            if not header:
                break
            tensors = []
            for name, shape, dtype in header:
                t = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
                tensors.append((name, self._bcast(t)))
            engine.update_weights(tensors, version)
            count += len(tensors)
        engine.weight_version = int(version)
        return count
