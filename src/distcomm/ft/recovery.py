"""Moving a replica's state to a peer that fell behind: raw bytes, JSON metadata, a checksum.

A state is a tree of dicts and lists whose leaves are NumPy arrays, torch
CPU tensors (what a torch ``state_dict()`` holds; sent as arrays, received as
tensors sharing the received arrays' memory) or JSON values (numbers,
strings, booleans, None).  Dict keys are strings, or numbers, booleans and
None (a torch optimizer's ``state_dict()`` keys its state by int).  On the wire (one TCP connection
per transfer, the receiver asks)::

    receiver -> {"step": S, "commit_id": C}\\n                     (JSON line)
    sender   -> {"ok": true, "step": S, "commit_id": C, "tree": ..., "arrays": [...],
                 "nbytes": N, "checksum": "blake2b-128"}\\n        (JSON line)
                the arrays' bytes, back to back (N bytes)
                16 bytes: blake2b-128 of those N bytes

Arrays are written from the sender's memory and read with ``recv_into``
straight into arrays the receiver keeps from one recovery to the next (when
the dtype and shape match), so a 10 MB model costs no copies besides the
checksum.  A checksum mismatch raises :class:`ChecksumError` before anything
is loaded; the caller then tries another peer.  Anything that is neither an
array nor a JSON value is refused unless both sides allow pickle.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import pickle
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..arrays import is_torch_tensor
from ..errors import DistError, DistNetworkError, DistTypeError
from ..sockets import shutdown_quietly
from ._net import accept_loop, listen, parse_host_port, readline

__all__ = ["ChecksumError", "RecoveryServer", "Transfer", "fetch_state", "flatten", "unflatten"]

log = logging.getLogger("distcomm.ft")
DIGEST = 16
CHUNK = 4 << 20


class ChecksumError(DistError):
    """The state received did not match its checksum; it was not loaded."""


# -- trees <-> (JSON, arrays) ---------------------------------------------------------------
def _tensor_as_array(t: Any) -> tuple[np.ndarray, str]:
    """A torch tensor's bytes as a NumPy array (no copy for a contiguous CPU tensor) and its dtype."""
    t = t.detach()
    if t.is_sparse or t.device.type != "cpu":
        t = t.to_dense().cpu() if t.is_sparse else t.cpu()
    t = t.contiguous()
    try:
        arr = t.numpy()
    except TypeError:  # a dtype NumPy lacks (bfloat16, ...): its bytes as unsigned ints of the same size
        import torch

        arr = t.view(getattr(torch, f"uint{8 * t.element_size()}")).numpy()
    return arr, str(t.dtype).removeprefix("torch.")


def _tensor_of(arr: np.ndarray, dtype: str) -> Any:
    import torch

    t = torch.from_numpy(arr)
    want = getattr(torch, dtype, None)
    if not isinstance(want, torch.dtype):
        raise DistTypeError(f"the peer sent a tensor of unknown torch dtype {dtype!r}")
    return t if t.dtype == want else t.view(want)


def flatten(tree: Any, allow_pickle: bool = False, path: str = "") -> tuple[Any, list[np.ndarray]]:
    arrays: list[np.ndarray] = []

    def walk(obj: Any, where: str) -> Any:
        if isinstance(obj, np.ndarray):
            arrays.append(obj if obj.flags.c_contiguous else np.ascontiguousarray(obj))
            return {"$array": len(arrays) - 1}
        if is_torch_tensor(obj):
            arr, dtype = _tensor_as_array(obj)
            arrays.append(arr)
            return {"$tensor": len(arrays) - 1, "dtype": dtype}
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                for k in obj:
                    if not (k is None or isinstance(k, (str, int, float))):
                        raise DistTypeError(f"state key {k!r} at {where or '/'} is not a str, number, bool or None")
                return {"$items": [[k, walk(v, f"{where}/{k}")] for k, v in obj.items()]}
            out = {}
            for k, v in obj.items():
                out[k] = walk(v, f"{where}/{k}")
            return {"$dict": out} if any(k.startswith("$") for k in out) else out
        if isinstance(obj, (list, tuple)):
            return [walk(v, f"{where}/{i}") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, np.generic):
            return {"$scalar": obj.dtype.str, "value": obj.item()}
        if allow_pickle:
            return {"$pickle": base64.b64encode(pickle.dumps(obj)).decode()}
        raise DistTypeError(
            f"state value at {where or '/'} is a {type(obj).__name__}: only NumPy arrays, torch tensors, "
            "dicts, lists and JSON values move without pickle (allow_pickle=True on both sides to send it)"
        )

    return walk(tree, path), arrays


def unflatten(meta: Any, arrays: list[np.ndarray], allow_pickle: bool = False) -> Any:
    if isinstance(meta, list):
        return [unflatten(v, arrays, allow_pickle) for v in meta]
    if isinstance(meta, dict):
        if "$array" in meta:
            return arrays[meta["$array"]]
        if "$tensor" in meta:
            return _tensor_of(arrays[meta["$tensor"]], meta["dtype"])
        if "$items" in meta:
            return {k: unflatten(v, arrays, allow_pickle) for k, v in meta["$items"]}
        if "$scalar" in meta:
            return np.dtype(meta["$scalar"]).type(meta["value"])
        if "$pickle" in meta:
            if not allow_pickle:
                raise DistTypeError("the peer sent a pickled value; pass allow_pickle=True to accept it")
            return pickle.loads(base64.b64decode(meta["$pickle"]))
        if "$dict" in meta:
            meta = meta["$dict"]
        return {k: unflatten(v, arrays, allow_pickle) for k, v in meta.items()}
    return meta


def _dtype_spec(dt: np.dtype) -> dict:
    """An array's dtype as JSON: ``dtype.str``, or the fields of a structured dtype."""
    return {"descr": dt.descr} if dt.fields is not None else {"dtype": dt.str}


def _dtype_of(spec: dict) -> np.dtype:
    if "descr" in spec:
        return np.dtype(_fields(spec["descr"]))
    return np.dtype(spec["dtype"])


def _fields(descr: list) -> list[tuple]:
    """A structured dtype's ``descr`` back from JSON (lists to tuples, nested fields too)."""
    out = []
    for name, kind, *shape in descr:
        out.append((tuple(name) if isinstance(name, list) else name,
                    _fields(kind) if isinstance(kind, list) else kind, *(tuple(s) for s in shape)))
    return out


# -- the sending side -------------------------------------------------------------------------
class RecoveryServer:
    """Serves ``snapshot(step, commit_id) -> (step, commit_id, tree)`` to peers that ask.

    ``done()`` is called when a transfer whose snapshot was taken ends (sent
    or not): until then the snapshot's arrays are being read.
    """

    def __init__(self, host: str, snapshot: Callable[[int, str], tuple[int, str, Any]], *,
                 allow_pickle: bool = False, done: Callable[[], None] | None = None) -> None:
        self._snapshot = snapshot
        self._done = done
        self.allow_pickle = allow_pickle
        self.corrupt_next = 0  # tests: flip a byte in the next N transfers
        self._conns: dict[socket.socket, tuple[str, str]] = {}  # transfers in flight: to whom
        self._lock = threading.Lock()
        self._sock, self.address = listen(host)
        self._sock.settimeout(0.2)
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept_loop, name="distcomm-ft-recovery", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        accept_loop(self._sock, lambda: self._closed, self._serve, "distcomm-ft-recovery-send", self._threads,
                    self._lock)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30.0)
                req = json.loads(readline(conn))
                step, commit_id = int(req["step"]), str(req.get("commit_id", ""))
                peer = (str(req.get("replica_id", "")), str(req.get("instance", "")))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.info("a state request could not be read: %s", e)
                return
            try:
                snap = self._snapshot(step, commit_id)
            except Exception as e:  # noqa: BLE001 - logged here, told to the peer
                self._refuse(conn, e)
                return
            with self._lock:
                self._conns[conn] = peer
            try:
                self._send(conn, *snap)
            finally:
                with self._lock:
                    self._conns.pop(conn, None)
                if self._done is not None:
                    self._done()

    def _refuse(self, conn: socket.socket, e: BaseException) -> None:
        log.warning("cannot send this replica's state to a peer: %s", e)
        try:
            conn.sendall(json.dumps({"ok": False, "error": str(e)}).encode() + b"\n")
        except OSError:
            pass

    def _send(self, conn: socket.socket, step: int, commit_id: str, tree: Any) -> None:
        try:
            meta, arrays = flatten(tree, self.allow_pickle)
        except Exception as e:  # noqa: BLE001 - logged here, told to the peer
            self._refuse(conn, e)
            return
        descr = [{**_dtype_spec(a.dtype), "shape": list(a.shape), "nbytes": a.nbytes} for a in arrays]
        head = {"ok": True, "step": step, "commit_id": commit_id, "tree": meta, "arrays": descr,
                "nbytes": sum(a.nbytes for a in arrays), "checksum": "blake2b-128"}
        try:
            conn.sendall(json.dumps(head).encode() + b"\n")
            self._send_arrays(conn, arrays)
        except OSError as e:
            log.info("state transfer to a peer ended early: %s", e)

    def _send_arrays(self, conn: socket.socket, arrays: list[np.ndarray]) -> None:
        digest = hashlib.blake2b(digest_size=DIGEST)
        corrupt = self.corrupt_next > 0
        if corrupt:
            self.corrupt_next -= 1
        for a in arrays:
            view = memoryview(a.reshape(-1).view(np.uint8))
            for off in range(0, len(view), CHUNK):
                part = view[off : off + CHUNK]
                digest.update(part)
                if corrupt and len(part):
                    bad = bytearray(part)
                    bad[len(bad) // 2] ^= 0xFF
                    conn.sendall(bad)
                    corrupt = False
                else:
                    conn.sendall(part)
        conn.sendall(digest.digest())

    def cut_transfers(self) -> None:
        """Break the transfers in flight (their receivers see a broken transfer)."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            shutdown_quietly(conn)

    def cut_transfers_to(self, replica_id: str, instance: str = "") -> int:
        """Break the transfers in flight to ``replica_id`` (that process instance, if both
        sides know it): one declared dead may be frozen, and would hold this replica's next
        commit until the send timed out.  Returns how many were cut."""
        with self._lock:
            conns = [c for c, (rid, inst) in self._conns.items()
                     if rid == replica_id and (not instance or not inst or inst == instance)]
        for conn in conns:
            shutdown_quietly(conn)
        return len(conns)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._thread.join(5.0)
        with self._lock:
            serving = list(self._threads)
        for t in serving:
            t.join(5.0)


# -- the receiving side ---------------------------------------------------------------------------
class Transfer:
    """A handle on one :func:`fetch_state` in progress, to abandon it from another thread.

    :meth:`abandon` (the sender was declared dead, say) shuts the transfer's
    socket down, which ends a wait to connect, for the answer or for the
    bytes at once; ``fetch_state`` then raises a ``DistNetworkError`` that
    gives ``why``.  Abandoning before the transfer starts makes it fail at
    the start.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.abandoned: str | None = None

    def abandon(self, why: str) -> None:
        with self._lock:
            if self.abandoned is None:
                self.abandoned = why
            sock = self._sock
        if sock is not None:
            shutdown_quietly(sock)

    def _attach(self, sock: socket.socket | None) -> str | None:
        """Watch ``sock`` (None: stop watching); the reason if already abandoned."""
        with self._lock:
            self._sock = sock
            return self.abandoned


def _connect(host: str, port: int, timeout: float, transfer: Transfer | None) -> socket.socket:
    """``socket.create_connection``, but a connect in progress is ended by ``transfer.abandon``."""
    if transfer is None:
        return socket.create_connection((host, port), timeout=timeout)
    error: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            if transfer._attach(sock) is not None:
                break
            sock.connect(addr)
            return sock
        except OSError as e:
            error = e
            sock.close()
    else:
        raise error or OSError(f"no address for {host}")
    sock.close()
    raise OSError("abandoned")


def fetch_state(address: str, step: int, commit_id: str, staging: dict[int, np.ndarray], *,
                timeout: float = 30.0, allow_pickle: bool = False,
                transfer: Transfer | None = None, requester: dict | None = None) -> tuple[int, str, Any]:
    """Fetch the state at ``step`` from the peer at ``address``; verified before returned.

    ``staging`` maps an array's position to the array it was last received
    into; matching arrays are reused, others replaced.  ``transfer`` (a
    :class:`Transfer`) lets another thread abandon the fetch.
    """
    try:
        return _fetch(address, step, commit_id, staging, timeout, allow_pickle, transfer, requester)
    except (DistNetworkError, OSError, ValueError) as e:
        why = transfer.abandoned if transfer is not None else None
        if why is None:
            raise
        raise DistNetworkError(f"state transfer from {address} abandoned: {why}", addr=address) from e
    finally:
        if transfer is not None:
            transfer._attach(None)


def _fetch(address: str, step: int, commit_id: str, staging: dict[int, np.ndarray], timeout: float,
           allow_pickle: bool, transfer: Transfer | None,
           requester: dict | None = None) -> tuple[int, str, Any]:
    try:
        conn = _connect(*parse_host_port(address, "address"), timeout, transfer)
    except OSError as e:
        raise DistNetworkError(f"cannot reach the peer's state server at {address}: {e}", addr=address) from e
    with conn:
        try:
            conn.settimeout(timeout)
            conn.sendall(json.dumps({"step": step, "commit_id": commit_id, **(requester or {})}).encode() + b"\n")
            head = json.loads(readline(conn) or b"{}")
            if not head.get("ok"):
                raise DistNetworkError(f"the peer at {address} cannot send its state: "
                                       f"{head.get('error', 'no answer')}", addr=address)
            arrays = []
            digest = hashlib.blake2b(digest_size=DIGEST)
            for i, d in enumerate(head["arrays"]):
                dt, shape = _dtype_of(d), tuple(d["shape"])
                if dt.itemsize * int(np.prod(shape)) != d["nbytes"]:
                    raise DistNetworkError(f"the peer at {address} described array {i} inconsistently "
                                           f"({d})", addr=address)
                arr = staging.get(i)
                if arr is None or arr.dtype != dt or arr.shape != shape:
                    arr = staging[i] = np.empty(shape, dt)
                view = memoryview(arr.reshape(-1).view(np.uint8))
                _recv_into(conn, view, address)
                digest.update(view)
                arrays.append(arr)
            theirs = bytearray(DIGEST)
            _recv_into(conn, memoryview(theirs), address)
        except DistNetworkError:
            raise
        except OSError as e:
            raise DistNetworkError(f"state transfer from {address} broke: {e}", addr=address) from e
    if digest.digest() != bytes(theirs):
        raise ChecksumError(
            f"the state received from {address} ({head['nbytes']} bytes, step {head['step']}) does not "
            "match its checksum; it was not loaded", addr=address,
        )
    return head["step"], head["commit_id"], unflatten(head["tree"], arrays, allow_pickle)


def _recv_into(conn: socket.socket, view: memoryview, address: str) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], min(len(view) - got, CHUNK))
        if n == 0:
            raise DistNetworkError(f"the peer at {address} closed the connection mid-transfer", addr=address)
        got += n
