"""Collective weight sync: the trainer broadcasts its weights to rollouter processes over a process
group of their own (NCCL on CUDA, gloo on CPU: one code path).

Group
-----
``1 + R`` members: member 0 is the writer (the trainer), members ``1..R`` rollouters. The writer
hosts a ``TCPStore`` on a port the OS picks when it hands out :meth:`CollectiveWeightSync.reader_handle`;
a reader registers there when it starts (:meth:`CollectiveWeightSync.wait_for_readers` waits for
that while checking the reader's process is alive); the group is built on it directly (``ProcessGroupNCCL`` / ``ProcessGroupGloo`` over a prefixed
store), never as the default group, so the trainer's own ``torch.distributed`` group (FSDP2) is
untouched. NCCL cannot put two members on one GPU: a rollouter on CUDA needs a device of its own
(one GPU shared by trainer and rollouter is ``cuda_ipc``).

One publish
-----------
The writer announces it in the store (``publish/<n> = version``), so a reader waits on a store
key, never inside a collective: an idle stretch between syncs can be as long as training takes
without hitting the group's timeout. Then, all broadcasts rooted at member 0:

* per bucket: a header ``int64[4] = (BUCKET, version, meta_bytes, data_bytes)``, the bucket's
  meta (``pickle`` of ``[(name, dtype, shape, offset)]`` as a uint8 tensor) and its data (one flat
  uint8 tensor holding every tensor's raw bytes at a 16-byte aligned offset);
* ``(COMMIT, version, tensors, 0)`` ends the version.

:meth:`CollectiveWeightSync.close` announces ``close`` instead, then waits (at most its ``wait_s``) until every
reader's receive thread has ended (``done/<member>``, set on its way out), since the store lives in the writer:
dropped before a reader's next poll, that poll fails with a network error (a C++ warning with its stack, and a
reader that raises on its next ``latest_version()``; seen under load, where the polling thread runs late).
Tensors are packed in publish order until the next one would pass ``bucket_bytes`` (``weight_sync.bucket_size_mb``); a tensor
larger than that travels alone, so peak extra memory on either side is ``max(bucket, largest
tensor)`` on the device. Bytes are copied, never converted: what a reader holds equals what the
writer was given bit for bit, any dtype (the trainer casts to the engine dtype before it
publishes, as for the other syncs).

Reader
------
:class:`CollectiveReader` runs a daemon thread in the rollouter process that waits for
announcements and receives every version: each bucket lands on the reader's device, is moved to
host memory and viewed as its tensors; at COMMIT (header version equal to the announced one) the
version becomes the newest. The rollouter applies it between generate calls (or at a
partial-rollout interrupt) through ``engine.update_weights`` (FP8/MX engines requantize there),
as with the other syncs, so the trainer's publish never waits for a generate call to end. Host
memory: one copy of the weights per held version (two while a newer one arrives during an apply).
A failure in the thread (the writer died mid-transfer, a timeout) is raised by the reader's next
``latest_version()``: a rollouter never keeps generating on weights that silently stopped updating.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lumenrl_async import plugin_manifest as manifest

__all__ = ["CollectiveWeightSync", "CollectiveReader", "WeightReceiveError"]

BUCKET, COMMIT = 1, 2
_ALIGN = 16
_ANNOUNCE = "publish/{}"
_READY = "reader/{}"
_CLOSE = "close"
_DONE = "done/{}"  # a reader's receive thread ended (set on its way out): the writer's store may go


class WeightReceiveError(RuntimeError):
    """The reader's receive thread failed; the rollouter must not go on with stale weights."""


def _open_group(store: Any, member: int, size: int, device: torch.device, timeout_s: float) -> Any:
    """The broadcast group over ``store``; ``timeout_s`` bounds its collectives on either backend
    (NCCL through ``ProcessGroupNCCL.Options._timeout``, as ``torch.distributed.new_group`` sets it)."""
    prefixed = dist.PrefixStore("lumenrl_weights/", store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, member, size, options)
    return dist.ProcessGroupGloo(prefixed, member, size, timeout)


def _broadcast(group: Any, tensor: torch.Tensor) -> torch.Tensor:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()
    return tensor


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _meta(name: str, t: torch.Tensor, offset: int) -> tuple[str, str, tuple[int, ...], int]:
    return name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset


class CollectiveWeightSync:
    """The writer (member 0, in the trainer process): ``reader_handle()`` once, then ``publish``."""

    capabilities = manifest.COLLECTIVE.capabilities

    def __init__(self, *, device: str | torch.device = "cpu", bucket_bytes: int = 512 << 20, readers: int = 1,
                 timeout_s: float = 600.0) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: expected >= 1")
        if readers < 1:
            raise ValueError(f"readers={readers}: expected >= 1")
        self.device = torch.device(device)
        self.bucket_bytes, self.readers, self.timeout_s = int(bucket_bytes), int(readers), float(timeout_s)
        self.store: Any = None
        self.group: Any = None
        self._version: int | None = None
        self._publishes = 0
        self._buffer: torch.Tensor | None = None

    @classmethod
    def probe(cls) -> str | None:
        return manifest.COLLECTIVE.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any) -> CollectiveWeightSync:
        """Device from ``cluster.device`` (this process's current CUDA device when CUDA is used),
        buckets of ``weight_sync.bucket_size_mb``; one reader (the rollouter)."""
        requested = run_config.cluster.device
        cuda = requested != "cpu" and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return cls(device=device, bucket_bytes=int(run_config.weight_sync.bucket_size_mb) << 20)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    # ------------------------------------------------------------------ set-up
    def reader_handle(self, host: str = "127.0.0.1") -> dict[str, Any]:
        """Start listening (once) and return what a reader needs (picklable): ``host`` is this
        process's address as the readers see it (another node: its IP)."""
        if self.store is None:
            self.store = dist.TCPStore(host, 0, self.readers + 1, True, timedelta(seconds=self.timeout_s),
                                       wait_for_workers=False)
        return {"host": host, "port": int(self.store.port), "size": self.readers + 1, "backend": self.backend,
                "timeout_s": self.timeout_s}

    @classmethod
    def reader(cls, handle: Mapping[str, Any], *, device: str | torch.device = "cpu", member: int = 1) -> CollectiveReader:
        """The reading side in a rollouter process, its receive thread started."""
        return CollectiveReader(handle, member=member, device=device).start()

    def wait_for_readers(self, alive: Callable[[], bool] = lambda: True, *, poll_s: float = 0.05) -> None:
        """Block until every reader registered (``CollectiveReader.start``); raise at once when
        ``alive()`` turns false (a rollouter that died before joining: the first publish would
        otherwise wait ``timeout_s`` for it inside the group's rendezvous)."""
        if self.store is None:
            raise RuntimeError("CollectiveWeightSync.wait_for_readers: call reader_handle() first")
        keys, deadline = [_READY.format(m) for m in range(1, self.readers + 1)], time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            if not alive():
                raise RuntimeError("a weight-sync reader ended before joining the broadcast group")
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight-sync readers did not join within {self.timeout_s:.0f} s")
            time.sleep(poll_s)

    # ------------------------------------------------------------------ publish
    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Broadcast ``named_tensors`` as ``version`` (greater than the last); returns what moved.
        The first publish forms the group: it waits (``timeout_s``) until every reader joined."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r}: expected a non-negative int")
        if self._version is not None and version <= self._version:
            raise ValueError(f"version={version} must be greater than the last published version {self._version}")
        if self.store is None:
            raise RuntimeError("CollectiveWeightSync.publish: call reader_handle() and start the readers first")
        start = time.perf_counter()
        self._publishes += 1
        self.store.set(_ANNOUNCE.format(self._publishes), str(version))
        if self.group is None:
            self.group = _open_group(self.store, 0, self.readers + 1, self.device, self.timeout_s)
        sent = count = 0
        pending: list[tuple[str, str, tuple[int, ...], int]] = []  # the open bucket's meta
        offset = 0
        for name in named_tensors:
            tensor = named_tensors[name]  # a lazy mapping gathers / casts here, one tensor at a time
            nbytes = _aligned(tensor.numel() * tensor.element_size())
            if pending and offset + nbytes > self.bucket_bytes:
                sent += self._send(pending, self._bucket()[:offset], version)
                pending, offset = [], 0
            if nbytes > self.bucket_bytes:  # travels alone, from its own storage
                sent += self._send([_meta(name, tensor, 0)], _as_bytes(tensor.to(self.device)), version)
            else:
                raw = _as_bytes(tensor)
                self._bucket()[offset : offset + raw.numel()].copy_(raw, non_blocking=True)
                pending.append(_meta(name, tensor, offset))
                offset += nbytes
            count += 1
        if pending:
            sent += self._send(pending, self._bucket()[:offset], version)
        self._header(COMMIT, version, count, 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._version = version
        return {"weight_sync/tensors": float(count), "weight_sync/gb": sent / 1e9,
                "timing/sync_s": time.perf_counter() - start}

    def _header(self, kind: int, version: int, a: int, b: int) -> None:
        _broadcast(self.group, torch.tensor([kind, version, a, b], dtype=torch.int64, device=self.device))

    def _send(self, meta: list[tuple[str, str, tuple[int, ...], int]], data: torch.Tensor, version: int) -> int:
        """One bucket: header, meta, data (flat uint8 on this device)."""
        meta_bytes = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(self.device)
        self._header(BUCKET, version, meta_bytes.numel(), data.numel())
        _broadcast(self.group, meta_bytes)
        _broadcast(self.group, data)
        return data.numel()

    def _bucket(self) -> torch.Tensor:
        """The reused (bucket_bytes,) uint8 send buffer."""
        if self._buffer is None:
            self._buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    def latest_version(self) -> int | None:
        return self._version

    def close(self, *, notify: bool = True, wait_s: float = 10.0) -> None:
        """Tell the readers to stop (``notify``: only while they are alive), wait until their receive threads
        ended (at most ``wait_s``, ``timeout_s`` if smaller: the store they poll lives here; module doc) and drop
        the group."""
        if self.store is not None and notify:
            self._publishes += 1
            self.store.set(_ANNOUNCE.format(self._publishes), _CLOSE)
            keys = [_DONE.format(m) for m in range(1, self.readers + 1)]
            deadline = time.monotonic() + min(wait_s, self.timeout_s)
            while not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.005)
        self.group, self._buffer = None, None


class CollectiveReader:
    """A rollouter's side (member ``member``): ``start()``, then ``latest_version()`` / ``load_into``."""

    def __init__(self, handle: Mapping[str, Any], *, member: int = 1, device: str | torch.device = "cpu",
                 poll_s: float = 0.05) -> None:
        if not 1 <= member < int(handle["size"]):
            raise ValueError(f"member={member}: readers are 1..{int(handle['size']) - 1}")
        self.handle, self.member, self.device = dict(handle), member, torch.device(device)
        if (self.device.type == "cuda") != (handle["backend"] == "nccl"):
            raise ValueError(f"device={self.device}: the writer's group is {handle['backend']} "
                             f"({'a CUDA' if handle['backend'] == 'nccl' else 'a CPU'} device needed)")
        self.poll_s = poll_s
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._close_announced = False
        self._finished = threading.Event()

    @property
    def closed(self) -> bool:
        """The writer closed the stream and the receive thread is gone (its group torn down)."""
        return self._close_announced and self._finished.is_set()

    def start(self) -> CollectiveReader:
        """Connect to the writer's store (here: a wrong address fails now) and register as ready,
        then receive in a daemon thread."""
        h = self.handle
        store = dist.TCPStore(h["host"], int(h["port"]), int(h["size"]), False, timedelta(seconds=h["timeout_s"]))
        store.set(_READY.format(self.member), "1")
        self._thread = threading.Thread(target=self._guarded, args=(store,), daemon=True,
                                        name="lumenrl-weight-receiver")
        self._thread.start()
        return self

    def _guarded(self, store: Any) -> None:
        try:
            self._loop(store)  # returns after its group is released (a process exiting during that aborts)
        except BaseException as exc:  # surfaced by latest_version()
            self._error = exc
        finally:
            self._finished.set()
            with contextlib.suppress(Exception):  # the writer's close waits for this (module doc); gone: nothing
                store.set(_DONE.format(self.member), "1")

    def _loop(self, store: Any) -> None:
        h = self.handle
        group, n = None, 0
        while not self._stop.is_set():
            n += 1
            announced = self._wait_announce(store, _ANNOUNCE.format(n))
            if announced is None or announced == _CLOSE:
                self._close_announced = announced == _CLOSE
                return
            if group is None:
                group = _open_group(store, self.member, int(h["size"]), self.device, float(h["timeout_s"]))
            version, tensors = self._receive(group, int(announced))
            with self._lock:
                self._latest = (version, tensors)

    def _wait_announce(self, store: Any, key: str) -> str | None:
        while not self._stop.is_set():
            if store.check([key]):
                return store.get(key).decode()
            time.sleep(self.poll_s)
        return None

    def _header(self, group: Any) -> list[int]:
        return _broadcast(group, torch.empty(4, dtype=torch.int64, device=self.device)).tolist()

    def _receive(self, group: Any, announced: int) -> tuple[int, dict[str, torch.Tensor]]:
        tensors: dict[str, torch.Tensor] = {}
        while True:
            kind, version, a, b = self._header(group)
            if version != announced:
                raise WeightReceiveError(f"header version {version} != announced {announced}: stream out of step")
            if kind == COMMIT:
                if a != len(tensors):
                    raise WeightReceiveError(f"version {version}: {len(tensors)} tensors received, writer sent {a}")
                return version, tensors
            meta = pickle.loads(_broadcast(group, torch.empty(a, dtype=torch.uint8, device=self.device)).cpu().numpy().tobytes())
            flat = _broadcast(group, torch.empty(b, dtype=torch.uint8, device=self.device)).cpu()
            for name, dtype, shape, offset in meta:
                dt = getattr(torch, dtype)
                nbytes = torch.Size(shape).numel() * dt.itemsize
                tensors[name] = flat[offset : offset + nbytes].view(dt).view(shape)

    # ------------------------------------------------------------------ the rollouter's view
    def latest_version(self) -> int | None:
        if self._error is not None:
            raise WeightReceiveError(f"weight receiver failed: {type(self._error).__name__}: {self._error}") \
                from self._error
        latest = self._latest
        return None if latest is None else latest[0]

    def latest(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        self.latest_version()  # raises a receiver failure
        with self._lock:
            return None if self._latest is None else (self._latest[0], dict(self._latest[1]))

    def load_into(self, engine: Any) -> int | None:
        """Apply the newest received version if newer than the engine's; the engine's version."""
        got = self.latest()
        if got is None:
            return None
        version, tensors = got
        if version > int(getattr(engine, "weight_version", -1)):
            engine.update_weights(tensors, version)
        return int(engine.weight_version)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
