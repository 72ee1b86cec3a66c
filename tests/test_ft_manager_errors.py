"""The Manager's contract at its edges: stable state during a transfer, failing state
functions, the group kinds it accepts, bad inputs and calls out of order."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time

import numpy as np
import pytest

from distcomm.errors import DistBackendError, DistInputError, DistTypeError
from distcomm.ft import (
    ErrorSwallowingProcessGroupWrapper,
    LighthouseThread,
    ManagedProcessGroup,
    Manager,
    ProcessGroupWrapper,
    ReconfigurableProcessGroup,
    StateDictError,
    SubprocessProcessGroup,
)
from distcomm.ft._net import readline
from distcomm.ft.recovery import DIGEST, RecoveryServer, fetch_state
from distcomm.testing import run_ranks

QUIET = {"DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE": "0"}


def _step(m: Manager, g: np.ndarray) -> bool:
    m.start_quorum()
    m.allreduce(g)
    return m.should_commit()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        assert chunk, "the sender closed the transfer"
        buf += chunk
    return bytes(buf)


@pytest.mark.timeout(30)
def test_a_commit_waits_for_a_transfer_of_the_state_in_flight():
    """A slow receiver: the sender's commit (after which the state changes) waits for the
    transfer to end, so the bytes received are one state and match the checksum."""
    w = np.zeros(16 << 20, np.float32)  # 64 MB: more than the socket buffers hold
    with LighthouseThread(min_replicas=1) as lh, Manager("r0", lh.address, timeout=10) as m:
        m.register_state_dict_fn("w", None, lambda: w)
        assert _step(m, np.ones(1))
        w[[0, -1]] -= 1
        m.start_quorum()  # step 1 is served from here until its commit
        host, port = m._recovery.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(json.dumps({"step": 1, "commit_id": m.commit_id}).encode() + b"\n")
            head = json.loads(readline(sock))
            done = threading.Event()

            def commit_and_change() -> None:
                m.allreduce(np.ones(1))
                if m.should_commit():
                    w[[0, -1]] -= 1  # both ends move together at every commit
                done.set()

            t = threading.Thread(target=commit_and_change)
            t.start()
            time.sleep(0.5)
            blocked = not done.is_set()
            data = _read_exact(sock, head["nbytes"] + DIGEST)
            t.join(10)
        got = np.frombuffer(data[: head["nbytes"]], np.float32)
        assert blocked and done.is_set()
        assert hashlib.blake2b(data[: head["nbytes"]], digest_size=DIGEST).digest() == data[-DIGEST:]
        assert got[0] == got[-1] == -1.0 and w[0] == w[-1] == -2.0


def _replica_with_failing_state_fn(rank: int, world: int, lh_addr: str, mode: str) -> dict:
    """r0 trains; r1 joins late and heals from r0 while ``mode`` breaks one side."""
    if rank == 1:
        time.sleep(1.0)
    w = np.zeros(4)

    def save() -> np.ndarray:
        if mode == "save" and rank == 0:
            raise RuntimeError("save exploded")
        return w

    def load(state: np.ndarray) -> None:
        if mode == "load":
            raise RuntimeError("load exploded")
        np.copyto(w, state)

    m = Manager(f"r{rank}", lh_addr, timeout=5, quorum_timeout=20)
    if not (mode == "unregistered" and rank == 1):
        m.register_state_dict_fn("w", load, save)
    errors, together = [], 0
    try:
        while m.current_step() < 15 or (rank == 0 and together < 10):
            ok = _step(m, np.ones(4))
            together += len(m.quorum["members"]) == 2 or together > 0
            if m.errored() is not None:
                errors.append(str(m.errored()))
            if ok:
                w[:] -= 1
            time.sleep(0.02)
        return {"raised": None, "errors": errors}
    except StateDictError as e:
        return {"raised": str(e), "cause": repr(e.__cause__), "errors": errors}
    finally:
        m.shutdown()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("mode", ["save", "load", "unregistered"])
def test_a_failing_state_function_is_raised_by_its_replica_and_the_others_go_on(mode):
    with LighthouseThread(min_replicas=1, join_timeout=0.3) as lh:
        r0, r1 = run_ranks(_replica_with_failing_state_fn, 2, lh.address, mode, timeout=35, env=QUIET)
    bad, good = (r0, r1) if mode == "save" else (r1, r0)
    expected = {"save": "save_fn of state 'w' raised on replica r0: RuntimeError: save exploded",
                "load": "load_fn of state 'w' raised on replica r1: RuntimeError: load exploded",
                "unregistered": "replica r1 must recover step"}[mode]
    assert bad["raised"] is not None and expected in bad["raised"], bad
    if mode != "unregistered":
        assert "exploded" in bad["cause"]
    assert good["raised"] is None and not any("calls differ" in e for e in good["errors"]), good
    if mode == "save":  # the healer was told why
        assert any(expected in e for e in good["errors"]), good["errors"]


@pytest.mark.timeout(20)
def test_max_retries_bounds_consecutive_discarded_steps():
    with LighthouseThread(min_replicas=1) as lh, Manager("r0", lh.address, max_retries=2) as m:
        m.register_state_dict_fn("w", None, lambda: np.zeros(1))
        for _ in range(2):
            m.start_quorum()
            m.report_error(RuntimeError("bad batch"))
            assert not m.should_commit()
        assert _step(m, np.ones(1))  # a commit resets the count
        for _ in range(2):
            m.start_quorum()
            m.report_error(RuntimeError("bad batch"))
            assert not m.should_commit()
        m.start_quorum()
        m.report_error(RuntimeError("bad batch"))
        with pytest.raises(DistBackendError, match=r"3 steps in a row .*max_retries=2.*bad batch"):
            m.should_commit()
    with pytest.raises(DistInputError, match="max_retries"):
        Manager("r0", "127.0.0.1:1", max_retries=-1)


_GROUP_KINDS = {
    "reconfigurable": lambda: ReconfigurableProcessGroup("auto", 10),
    "wrapper": lambda: ProcessGroupWrapper(ReconfigurableProcessGroup("auto", 10)),
    "swallowing": lambda: ErrorSwallowingProcessGroupWrapper(ReconfigurableProcessGroup("auto", 10)),
    "subprocess": lambda: SubprocessProcessGroup("auto", 10),
}


@pytest.mark.timeout(40)
def test_every_documented_group_kind_works_with_the_manager():
    with LighthouseThread(min_replicas=1) as lh:
        for kind, make in _GROUP_KINDS.items():
            with Manager(f"r-{kind}", lh.address, pg=make()) as m:
                m.register_state_dict_fn("w", None, lambda: np.zeros(1))
                g = np.full(2, 3.0)
                assert _step(m, g) and m.errored() is None, (kind, m.errored())
                assert g.tolist() == [3.0, 3.0] and m.current_step() == 1
        with Manager("r-managed", lh.address) as m:
            with pytest.raises(DistInputError, match="ManagedProcessGroup"):
                Manager("r-x", lh.address, pg=ManagedProcessGroup(m))
        with pytest.raises(DistInputError, match="pg= must be a group the manager can configure"):
            Manager("r-y", lh.address, pg=ProcessGroupWrapper(None))


@pytest.mark.timeout(20)
def test_arguments_and_call_order_are_checked_before_anything_is_sent():
    with LighthouseThread(min_replicas=1) as lh:
        m = Manager("r0", lh.address)
        m.register_state_dict_fn("w", None, lambda: np.zeros(1))
        with pytest.raises(DistInputError, match="start_quorum"):
            m.allreduce(np.ones(1))
        m.start_quorum()
        with pytest.raises(DistInputError, match="cannot average an array of dtype bool"):
            m.allreduce(np.array([True]))
        with pytest.raises(DistTypeError):
            m.allreduce([1.0])
        assert m.errored() is None  # argument mistakes do not fail the step
        assert m.should_commit() and m.current_step() == 1
        with pytest.raises(DistInputError, match="should_commit.*outside a step"):
            m.should_commit()
        assert m.current_step() == 1
        m.shutdown()
        for call in (lambda: m.allreduce(np.ones(1)), m.should_commit, m.start_quorum):
            with pytest.raises(DistBackendError, match="shut down"):
                call()


@pytest.mark.timeout(10)
def test_structured_and_void_arrays_are_transferred():
    state = {"rec": np.array([(1.5, 2), (3.0, -1)], dtype=[("a", "f4"), ("b", "i2", (2,))]),
             "raw": np.frombuffer(b"abcdefghijkl", "V6").copy(), "nested": np.zeros(2, [("x", [("y", "u1")])])}
    srv = RecoveryServer("127.0.0.1", lambda step, cid: (step, cid, state))
    try:
        _, _, got = fetch_state(srv.address, 0, "", {}, timeout=5)
    finally:
        srv.close()
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


@pytest.mark.timeout(10)
def test_a_swallowing_wrapper_raises_argument_mistakes_after_an_error():
    from distcomm.store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ErrorSwallowingProcessGroupWrapper(ReconfigurableProcessGroup("tcp", 5))
    try:
        pg.configure(f"127.0.0.1:{store.port}/a", 0, 1)
        pg.report_error(DistBackendError("a peer died"))
        with pytest.raises(DistInputError, match="not a reduce op"):
            pg.allreduce(np.ones(1), "bogus")
        with pytest.raises(DistTypeError):
            pg.allreduce([1.0], "sum")
        with pytest.raises(DistInputError, match="src 5 is not a rank"):
            pg.broadcast(np.ones(1), 5)
        with pytest.raises(DistTypeError, match="broadcast"):
            pg.broadcast(np.ones(1), 0, 1, 2)
        a = np.ones(1)
        pg.allreduce(a, "sum")  # well formed: skipped, input unchanged
        assert a.tolist() == [1.0] and "a peer died" in str(pg.error())
    finally:
        pg.shutdown()
        store.close()


@pytest.mark.timeout(20)
def test_any_failure_of_one_peer_makes_recovery_try_the_next():
    """A peer answering what the receiver cannot read (a TypeError there) is skipped."""
    bad = socket.create_server(("127.0.0.1", 0))

    def answer_nonsense() -> None:
        conn, _ = bad.accept()
        with conn:
            readline(conn)
            head = {"ok": True, "step": 4, "commit_id": "c", "tree": {"w": {"$array": 0}},
                    "arrays": [{"dtype": "no-such-dtype", "shape": [2], "nbytes": 16}], "nbytes": 16}
            conn.sendall(json.dumps(head).encode() + b"\n")

    t = threading.Thread(target=answer_nonsense)
    t.start()
    good = RecoveryServer("127.0.0.1", lambda step, cid: (step, "c", {"w": np.full(2, 5.0)}))
    w = np.zeros(2)
    try:
        with LighthouseThread(min_replicas=1) as lh, Manager("r0", lh.address) as m:
            m.register_state_dict_fn("w", None, lambda: w)
            peers = [{"replica_id": name, "commit_id": "c", "address": {"recovery": addr}}
                     for name, addr in (("bad", f"127.0.0.1:{bad.getsockname()[1]}"), ("good", good.address))]
            m._heal(peers, 0, 4)
            assert m.current_step() == 4 and w.tolist() == [5.0, 5.0]
    finally:
        t.join(5)
        bad.close()
        good.close()
