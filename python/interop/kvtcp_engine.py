"""A pure-Python ``TransferEngine`` (Mooncake's API, as much of it as
sglang 0.5.23's PD connector calls) that speaks kvbridge's TCP engine wire in
open mode (no cluster secret), host memory only.

It is the harness's stand-in engine: until the ``kvbridge`` Python package
(``crates/kvbridge-py``) is installed, it lets sglang's connector exchange
real KV bytes with ``kvbridge prefill`` / ``kvbridge decode`` ranks, whose TCP
engine it talks to; between two sglang ranks it is the self-test of the
engine switch. It pins the contract ``kvbridge.TransferEngine`` must honour:
``initialize`` and every call return 0 on success, writes are synchronous,
the session id is ``host:rpc_port``, writes land only in registered memory.

The wire is ``docs/engines.md`` ("TCP engine", "Framing"), little-endian:

* set-up: client ``Hello`` = ``"KVBT" | version u16 (2) | flags u16 | nonce
  [32] | incarnation u64 | session length u16 | session id``; server
  ``Challenge`` = ``"KVBT" | version | flags | incarnation u64 | nonce [32] |
  proof [32]``; client ``Response`` = proof [32]; server ``Verdict`` =
  ``status u32 | 0 u32``. In open mode flags are 0 and proofs are zeros.
* requests: ``Header`` = ``op u8 | 0 [3] | count u32 | seq u64 | payload
  u64``; ``Write`` (1) carries ``count x (dst u64, len u64)`` then the
  payload, ``Check`` (2) the descriptors only, ``Ping`` (3) nothing; each is
  answered by an ``Ack`` = ``seq u64 | status u32 | block index u32``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import socketserver
import struct
import threading
from typing import Dict, List, Optional, Sequence, Tuple

MAGIC = b"KVBT"
VERSION = 2
NONCE_LEN = 32
OP_WRITE, OP_CHECK, OP_PING = 1, 2, 3
ST_OK, ST_OUT_OF_REGION, ST_BAD_REQUEST = 0, 1, 2
VERDICT_OK = 0
#: Receiver limits (kvbridge: 65 536 descriptors, 1 GiB per request).
MAX_BLOCKS, MAX_BYTES = 1 << 16, 1 << 30
#: What this client puts in one Write request.
REQUEST_BLOCKS, REQUEST_BYTES = 8192, 16 << 20
MAX_SESSION_LEN = 512
_OK, _ERR = 0, -1


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def _header(op: int, count: int, seq: int, payload: int) -> bytes:
    return struct.pack("<B3xIQQ", op, count, seq, payload)


class _Regions:
    """Registered memory: ``ptr -> length``, thread-safe."""

    def __init__(self):
        self._map: Dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, ptr: int, length: int) -> None:
        with self._lock:
            self._map[ptr] = length

    def remove(self, ptr: int) -> bool:
        with self._lock:
            return self._map.pop(ptr, None) is not None

    def first_outside(self, blocks: Sequence[Tuple[int, int]]) -> Optional[int]:
        """Index of the first ``(addr, len)`` not inside one region, or None."""
        with self._lock:
            regions = list(self._map.items())
        for i, (addr, length) in enumerate(blocks):
            if not any(base <= addr and addr + length <= base + size for base, size in regions):
                return i
        return None


class TransferEngine:
    """``mooncake.engine.TransferEngine`` as sglang uses it, on kvbridge's TCP wire."""

    def __init__(self):
        self._regions = _Regions()
        self._server: Optional[socketserver.ThreadingTCPServer] = None
        self._session = ""
        self._incarnation = int.from_bytes(os.urandom(8), "little")
        self._conns: Dict[str, Tuple[socket.socket, threading.Lock]] = {}
        self._conns_lock = threading.Lock()
        self._seq = 0

    # -- lifecycle ---------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Listens on ``local_hostname`` (an IP, as sglang passes it) at a free
        port. Only ``"P2PHANDSHAKE"`` and protocol ``"tcp"`` are supported."""
        if metadata_server != "P2PHANDSHAKE" or protocol != "tcp":
            return _ERR
        engine = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    engine._serve(self.request)
                except (ConnectionError, OSError, ValueError):
                    return

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((local_hostname, 0), Handler)
        self._session = f"{local_hostname}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return _OK

    def get_rpc_port(self) -> int:
        return self._server.server_address[1]

    def get_engine(self):
        return self

    # -- memory ------------------------------------------------------------

    def register_memory(self, ptr: int, length: int) -> int:
        if length <= 0:
            return _ERR
        self._regions.add(int(ptr), int(length))
        return _OK

    def unregister_memory(self, ptr: int) -> int:
        return _OK if self._regions.remove(int(ptr)) else _ERR

    def batch_register_memory(self, ptrs: List[int], lengths: List[int]) -> int:
        results = [self.register_memory(p, n) for p, n in zip(ptrs, lengths)]
        return _OK if all(r == _OK for r in results) else _ERR

    def batch_unregister_memory(self, ptrs: List[int]) -> int:
        results = [self.unregister_memory(p) for p in ptrs]
        return _OK if all(r == _OK for r in results) else _ERR

    # -- client ------------------------------------------------------------

    def _connect(self, session_id: str) -> socket.socket:
        """A fresh connection to ``session_id`` (``host:port``), handshaken."""
        host, port = session_id.rsplit(":", 1)
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        me = self._session.encode()
        sock.sendall(MAGIC + struct.pack("<HH", VERSION, 0) + os.urandom(NONCE_LEN)
                     + struct.pack("<QH", self._incarnation, len(me)) + me)
        challenge = _recv_exact(sock, 16 + 2 * NONCE_LEN)
        magic, version = challenge[:4], struct.unpack_from("<H", challenge, 4)[0]
        if magic != MAGIC or version != VERSION:
            sock.close()
            raise ConnectionError(f"{session_id} is not a kvbridge TCP engine of version {VERSION}")
        sock.sendall(bytes(NONCE_LEN))  # open mode: no proof
        status = struct.unpack("<II", _recv_exact(sock, 8))[0]
        if status != VERDICT_OK:
            sock.close()
            raise ConnectionError(f"{session_id} refused the connection (verdict {status})")
        return sock

    def _conn(self, session_id: str) -> Tuple[socket.socket, threading.Lock]:
        with self._conns_lock:
            conn = self._conns.get(session_id)
            if conn is None:
                conn = (self._connect(session_id), threading.Lock())
                self._conns[session_id] = conn
            return conn

    def _drop(self, session_id: str) -> None:
        with self._conns_lock:
            conn = self._conns.pop(session_id, None)
        if conn:
            conn[0].close()

    def _next_seq(self) -> int:
        with self._conns_lock:
            self._seq += 1
            return self._seq

    def _request(self, sock: socket.socket, op: int, descs: Sequence[Tuple[int, int]], payload: bytes = b"") -> int:
        """Sends one request and returns its ack's status."""
        seq = self._next_seq()
        body = b"".join(struct.pack("<QQ", d, n) for d, n in descs)
        sock.sendall(_header(op, len(descs), seq, len(payload)) + body + payload)
        ack_seq, status, _index = struct.unpack("<QII", _recv_exact(sock, 16))
        if ack_seq != seq:
            raise ConnectionError(f"ack for request {ack_seq}, expected {seq}")
        return status

    def batch_transfer_sync_write(self, session_id: str, buffers: List[int],
                                  peer_buffer_addresses: List[int], lengths: List[int]) -> int:
        """Writes every ``(src, dst, len)`` block to the peer and returns 0
        once the peer acknowledged all of them; -1 when any is refused or the
        connection fails (nothing is written when a destination is refused
        by the all-blocks ``Check``)."""
        if not (len(buffers) == len(peer_buffer_addresses) == len(lengths)):
            return _ERR
        blocks = [(int(s), int(d), int(n)) for s, d, n in zip(buffers, peer_buffer_addresses, lengths) if n > 0]
        if self._regions.first_outside([(s, n) for s, _, n in blocks]) is not None:
            return _ERR  # sources must be registered here
        requests, current, size = [], [], 0
        for block in blocks:
            if current and (len(current) == REQUEST_BLOCKS or size + block[2] > REQUEST_BYTES):
                requests.append(current)
                current, size = [], 0
            current.append(block)
            size += block[2]
        if current:
            requests.append(current)
        try:
            sock, lock = self._conn(session_id)
            with lock:
                if len(requests) > 1:
                    descs = [(d, n) for _, d, n in blocks]
                    for i in range(0, len(descs), MAX_BLOCKS):
                        if self._request(sock, OP_CHECK, descs[i:i + MAX_BLOCKS]) != ST_OK:
                            return _ERR
                for request in requests:
                    payload = b"".join(ctypes.string_at(s, n) for s, _, n in request)
                    if self._request(sock, OP_WRITE, [(d, n) for _, d, n in request], payload) != ST_OK:
                        return _ERR
            return _OK
        except (OSError, ConnectionError):
            self._drop(session_id)
            return _ERR

    def transfer_sync_write(self, session_id: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return self.batch_transfer_sync_write(session_id, [buffer], [peer_buffer_address], [length])

    def send_probe(self, peer_session_id: str) -> int:
        """0 when a fresh connection to the peer handshakes and answers a ping."""
        try:
            sock = self._connect(peer_session_id)
            try:
                return _OK if self._request(sock, OP_PING, []) == ST_OK else _ERR
            finally:
                sock.close()
        except (OSError, ConnectionError):
            return _ERR

    # -- server ------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        """One accepted connection: handshake, then requests until it closes.
        Malformed input closes the connection."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _recv_exact(sock, 8 + NONCE_LEN)
        if hello[:4] != MAGIC:
            return
        challenge = (MAGIC + struct.pack("<HHQ", VERSION, 0, self._incarnation)
                     + os.urandom(NONCE_LEN) + bytes(NONCE_LEN))
        if struct.unpack_from("<H", hello, 4)[0] != VERSION:
            sock.sendall(challenge)  # the client reports the version mismatch
            return
        _incarnation, length = struct.unpack("<QH", _recv_exact(sock, 10))
        if not 1 <= length <= MAX_SESSION_LEN:
            return
        _recv_exact(sock, length)  # the client's session id (trusted in open mode)
        sock.sendall(challenge)
        _recv_exact(sock, NONCE_LEN)  # its proof: not checked in open mode
        sock.sendall(struct.pack("<II", VERDICT_OK, 0))
        while True:
            try:
                header = _recv_exact(sock, 24)
            except ConnectionError:
                return
            op, count, seq, payload = struct.unpack("<B3xIQQ", header)
            if header[1:4] != b"\0\0\0" or op not in (OP_WRITE, OP_CHECK, OP_PING):
                return
            if op == OP_PING:
                status, index = (ST_OK, 0) if count == 0 and payload == 0 else (ST_BAD_REQUEST, 0)
            else:
                if count > MAX_BLOCKS or payload > MAX_BYTES or (op == OP_CHECK and payload):
                    return
                raw = _recv_exact(sock, 16 * count)
                descs = [struct.unpack_from("<QQ", raw, 16 * i) for i in range(count)]
                if op == OP_WRITE and sum(n for _, n in descs) != payload:
                    return
                bad = self._regions.first_outside(descs)
                status, index = (ST_OK, 0) if bad is None else (ST_OUT_OF_REGION, bad)
                if op == OP_WRITE:
                    data = _recv_exact(sock, payload)
                    if bad is None:
                        offset = 0
                        for dst, n in descs:
                            ctypes.memmove(dst, data[offset:offset + n], n)
                            offset += n
            sock.sendall(struct.pack("<QII", seq, status, index))
