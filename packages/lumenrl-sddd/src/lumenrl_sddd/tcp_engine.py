"""TCP transfer engine: the producer serves its tensors over a socket, consumers pull them by key.

Wire format (one request per connection, no pickle): the client sends ``op`` (1 byte: ``G`` get,
``P`` pop, ``D`` delete), a 4-byte big-endian key length and the UTF-8 key; the server answers an
8-byte big-endian payload length (``2**64 - 1``: key missing) and the payload, the tensors in
safetensors format. The producer (``TCPTransferEngine(host=, port=)``, serving by default) binds
``host:port`` (port 0: any free port; ``address`` says which) in a daemon thread; a consumer
(``TCPTransferEngine(connect=(host, port))``) reads from it. On one machine use loopback.
``serve=False`` without ``connect``: a local store only (nothing bound). ``timeout`` (seconds) bounds
every socket operation on both sides: a consumer's connect and reads, and the producer's reads and
writes on each accepted connection (a stalled consumer's connection is dropped, not held forever).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lumenrl_core.storage import cpu_copies
from lumenrl_sddd import plugin_manifest as manifest

__all__ = ["TCPTransferEngine"]

_MISSING = 2**64 - 1


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"TCP transfer: connection closed with {left} of {size} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class TCPTransferEngine:
    """Key -> tensors over TCP (module docstring)."""

    capabilities = manifest.TCP.capabilities

    def __init__(self, *, host: str | None = None, port: int | None = None, serve: bool | None = None,
                 connect: tuple[str, int] | None = None, timeout: float = 60.0) -> None:
        """``host`` / ``port``: the producer's bind address (default ``127.0.0.1:0``); ``serve``:
        default true without ``connect``; ``connect``: the producer's address (a consumer)."""
        if connect is not None:
            for name, value in (("host", host), ("port", port)):
                if value is not None:
                    raise ValueError(f"TCPTransferEngine: {name}={value!r} with connect={connect!r}; a consumer "
                                     "binds nothing: pass the producer's address as connect only")
            if serve:
                raise ValueError(f"TCPTransferEngine: serve=True with connect={connect!r}; allowed: a producer "
                                 "(serve) or a consumer (connect), not both")
        elif serve is False:
            for name, value in (("host", host), ("port", port)):
                if value is not None:
                    raise ValueError(f"TCPTransferEngine: {name}={value!r} with serve=False; nothing is bound: "
                                     "drop it or serve")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"TCPTransferEngine: timeout={timeout!r}; expected seconds > 0")
        self._store: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._connect, self._timeout = connect, float(timeout)
        self._server: socket.socket | None = None
        self.address: tuple[str, int] | None = connect
        if connect is None and serve is not False:
            self._server = socket.create_server(("127.0.0.1" if host is None else host, 0 if port is None else port))
            self.address = self._server.getsockname()[:2]
            threading.Thread(target=self._serve, daemon=True, name="lumenrl-tcp-transfer").start()

    @classmethod
    def probe(cls) -> str | None:
        return manifest.TCP.unavailable_reason()

    @classmethod
    def from_config(cls, run_config: Any) -> TCPTransferEngine:
        s = run_config.sddd
        return cls(host=s.tcp_host, port=s.tcp_port)

    # ------------------------------------------------------------------ server side
    def _serve(self) -> None:
        server = self._server
        while server is not None:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(self._timeout)
        with conn, contextlib.suppress(OSError):  # a stalled or broken consumer: drop its connection
            op = _recv_exact(conn, 1)
            (size,) = struct.unpack(">I", _recv_exact(conn, 4))
            key = _recv_exact(conn, size).decode()
            with self._lock:
                payload = self._store.get(key)
                if op in (b"P", b"D"):
                    self._store.pop(key, None)
            if op == b"D":
                conn.sendall(struct.pack(">Q", 0))
            elif payload is None:
                conn.sendall(struct.pack(">Q", _MISSING))
            else:
                conn.sendall(struct.pack(">Q", len(payload)) + payload)

    # ------------------------------------------------------------------ engine API
    def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        if self._connect is not None:
            raise RuntimeError("TCPTransferEngine: a consumer (connect=...) cannot put; the producer serves")
        payload = st_save(cpu_copies(tensors))
        with self._lock:
            self._store[key] = payload

    def _request(self, op: bytes, key: str) -> bytes | None:
        if self._connect is None:
            with self._lock:
                payload = self._store.get(key)
                if op in (b"P", b"D"):
                    self._store.pop(key, None)
            return payload
        encoded = key.encode()
        with socket.create_connection(self._connect, timeout=self._timeout) as sock:
            sock.sendall(op + struct.pack(">I", len(encoded)) + encoded)
            (size,) = struct.unpack(">Q", _recv_exact(sock, 8))
            if op == b"D":
                return None
            return None if size == _MISSING else _recv_exact(sock, size)

    def get(self, key: str) -> dict[str, torch.Tensor]:
        return self._load(key, self._request(b"G", key))

    def pop(self, key: str) -> dict[str, torch.Tensor]:
        return self._load(key, self._request(b"P", key))

    @staticmethod
    def _load(key: str, payload: bytes | None) -> dict[str, torch.Tensor]:
        if payload is None:
            raise KeyError(f"transfer key {key!r} not found on the TCP producer")
        return st_load(payload)

    def delete(self, key: str) -> None:
        self._request(b"D", key)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._store)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        with self._lock:
            self._store.clear()
