"""The TCP transport's listener when the process runs out of file descriptors (someone
without the job token holding idle connections to it): a pause, one error, and the group
goes on; not a busy loop that logs an error at every turn."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

LIMIT = 64  # RLIMIT_NOFILE of the ranks' process (two transports use about 14)
FLOOD = 150  # idle connections to rank 1's listener: more than the process may hold

_RANKS = textwrap.dedent(f"""
    import logging, os, resource, sys, threading, time
    resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT}))
    import numpy as np
    from distcomm.deadline import Deadline
    from distcomm.store import HashStore
    from distcomm.transport.tcp import TcpTransport

    errors = []
    class Count(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())
    root = logging.getLogger("distcomm")
    root.addHandler(Count())
    root.propagate = False  # (a busy loop's thousands of lines: counted, not printed)

    store, token, made = HashStore(), os.urandom(16), {{}}
    def make(rank):
        made[rank] = TcpTransport(rank, 2, store, token, 30.0, "127.0.0.1", auth_token="k" * 64,
                                  hello_timeout=60.0)
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = made[0], made[1]
    ca, cb = a.channel(7, [0, 1]), b.channel(7, [0, 1])

    def exchange(tag):
        got = np.zeros(64, np.uint8)
        d = Deadline(20)
        reqs = [cb.irecv(0, tag, memoryview(got)), ca.isend(1, tag, memoryview(np.full(64, tag % 256, np.uint8)))]
        for r in reqs:
            r.wait(d)
        assert (got == tag % 256).all()

    def line():
        return sys.stdin.readline().strip()

    exchange(0)  # (rank 0 connects to rank 1 before the flood)
    print(b.address.rpartition(":")[2], flush=True)
    assert line() == "flooded"
    end = Deadline(20)
    while not errors and not end.expired():
        time.sleep(0.01)
    said = len(errors)
    for tag in range(1, 21):  # while the connections are held
        exchange(tag)
    print(f"held: first={{said}} errors={{len(errors)}} {{errors[:1]}}", flush=True)
    assert line() == "closed"
    for tag in range(21, 31):
        exchange(tag)
    print(f"after: errors={{len(errors)}}", flush=True)
    a.close()
    b.close()
""")


@pytest.mark.timeout(90)
def test_listener_out_of_fds_logs_once_and_the_group_goes_on():
    """Rank 1's listener flooded with idle connections past the process's RLIMIT_NOFILE:
    accept() fails with EMFILE; the transport says so once (one ERROR record, not one per
    turn of its progress thread) and exchanges between the ranks go on working, while the
    connections are held and after they are gone."""
    proc = subprocess.Popen([sys.executable, "-c", _RANKS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    flood: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(FLOOD):
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:  # (the listen queue is full: what is held is enough)
                break
        assert len(flood) > LIMIT
        proc.stdin.write("flooded\n")
        proc.stdin.flush()
        held = proc.stdout.readline()
        assert held.startswith("held: "), held
        for s in flood:
            s.close()
        flood.clear()
        proc.stdin.write("closed\n")
        proc.stdin.flush()
        after = proc.stdout.readline()
        assert proc.wait(30) == 0
    finally:
        for s in flood:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    fields = dict(f.split("=", 1) for f in held.split()[1:3])
    assert int(fields["first"]) >= 1, held  # (the flood did run the process out of fds)
    assert int(fields["errors"]) <= 2, held
    assert after.strip() == f"after: errors={fields['errors']}", (held, after)
