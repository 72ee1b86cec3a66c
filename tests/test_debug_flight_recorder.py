"""The flight recorder: the ring, dumps (failure, SIGUSR1, on request) and ``distcomm trace analyze``."""

from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist
from distcomm.cli import main as cli_main
from distcomm.debug import flight_recorder, recorder
from distcomm.debug.analyze import analyze

SHORT = 1.0  # timeout of the group that gets stuck


def run_stuck_then_desync(rank: int, world_size: int, backend: str, port: int, desync_dir: str) -> dict:
    """Group A: rank 1 never enters the third all_reduce; the others time out and dump,
    rank 1 dumps on SIGUSR1.  Group B: rank 1 calls broadcast where the others call
    all_reduce; every rank dumps on request into ``desync_dir``."""
    init(rank, world_size, backend, port, timeout=30)
    out: dict = {"pid": os.getpid()}
    try:
        a = dist.new_group(timeout=SHORT)
        b = dist.new_group(timeout=SHORT)
        dist.barrier(a)
        for _ in range(2):
            dist.all_reduce(np.ones(6, np.float32), group=a)
        if rank == 1:  # alive, elsewhere: "stuck" in user code (then in the barrier below)
            os.kill(os.getpid(), signal.SIGUSR1)  # what a user would send it
        else:
            try:
                dist.all_reduce(np.ones(6, np.float32), group=a)
            except dist.DistError as e:
                out["error"] = str(e)
        dist.barrier()
        os.environ[flight_recorder.ENV_ON_FAILURE] = "0"
        try:
            if rank == 1:
                dist.broadcast(np.ones(4, np.int32), src=0, group=b)
            else:
                dist.all_reduce(np.ones(4, np.int32), group=b)
        except dist.DistError:
            pass
        out["dump"] = dist.dump_flight_recorder(desync_dir)
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stuck_rank_and_order_mismatch_are_explained(backend, tmp_path):
    stuck_dir, desync_dir = tmp_path / "stuck", tmp_path / "desync"
    env = {flight_recorder.ENV_DIR: str(stuck_dir)}
    results = run_world(run_stuck_then_desync, 3, backend, str(desync_dir), timeout=75, env=env)
    for rank in (0, 2):
        assert "all_reduce (seq 4)" in results[rank]["error"]
    assert sorted(os.listdir(stuck_dir)) == ["rank0.json", "rank1.json", "rank2.json"]
    dump1 = json.loads((stuck_dir / "rank1.json").read_text())
    assert dump1["reason"] == "SIGUSR1" and dump1["pid"] == results[1]["pid"]
    dump0 = json.loads((stuck_dir / "rank0.json").read_text())
    instances = {json.loads((stuck_dir / f"rank{r}.json").read_text())["instance"] for r in range(3)}
    assert len(instances) == 1 and None not in instances, instances  # one initialisation's id
    failed = [e for e in dump0["entries"] if e["state"] == "failed"]
    assert failed and failed[0]["op"] == "all_reduce" and failed[0]["seq"] == 4
    assert failed[0]["shape"] == [6] and failed[0]["dtype"] == "float32" and failed[0]["reduce_op"] == "SUM"
    assert failed[0]["started"] <= failed[0]["finished"]

    report = analyze(str(stuck_dir))
    text = report.text()
    assert "rank 1 never entered all_reduce (seq 4, shape (6,) float32, SUM)" in text, text
    assert "which ranks 0, 2 entered" in report.causes[0], text
    assert "it is at" in text and "test_debug_flight_recorder.py" in text  # rank 1's own line

    report = analyze(str(desync_dir))
    mismatch = [f for f in report.findings if f["kind"] == "mismatch"]
    assert mismatch, report.text()
    assert "all_reduce (seq 1, shape (4,) int32, SUM) on ranks 0, 2 but broadcast (seq 1, shape (4,) int32, " \
           "root rank 0) on rank 1: the ranks issued collectives in different orders" in mismatch[0]["text"]


# -- single process ---------------------------------------------------------------------------


@pytest.fixture
def world_of_one():
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=10)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(30)
def test_ring_records_states_shapes_and_peers(world_of_one, tmp_path):
    recorder.ring.clear()
    t = np.ones((2, 3), np.float64)
    w = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    w.wait()
    dist.broadcast(np.ones(5, np.int8), src=0)
    entries = list(recorder.ring)
    assert [e[recorder.F_OP] for e in entries] == ["all_reduce", "broadcast"]
    assert all(e[recorder.F_STATE] == recorder.COMPLETED for e in entries)
    assert entries[0][recorder.F_INFO][:2] == ((2, 3), "float64")
    path = dist.dump_flight_recorder(str(tmp_path))
    assert path == str(tmp_path / "rank0.json")
    d = json.loads(open(path).read())
    assert d["rank"] == 0 and d["world_size"] == 1 and d["reason"].startswith("dump_flight_recorder")
    assert [e["op"] for e in d["entries"]] == ["all_reduce", "broadcast"]
    assert d["entries"][0]["shape"] == [2, 3] and d["entries"][0]["reduce_op"] == "MAX"
    assert d["entries"][1]["root"] == 0 and d["groups"][0]["ranks"] == [0]
    assert any(name.startswith("MainThread") for name in d["stacks"])


def test_ring_size_from_environment(monkeypatch):
    try:
        monkeypatch.setenv(recorder.ENV_SIZE, "3")
        recorder.configure()
        assert recorder.ring.maxlen == 3
        monkeypatch.setenv(recorder.ENV_SIZE, "0")
        recorder.configure()
        assert recorder.ring is None
        for bad in ("abc", "-5", "1.5"):
            monkeypatch.setenv(recorder.ENV_SIZE, bad)
            with pytest.warns(RuntimeWarning, match=rf"^DISTCOMM_FLIGHT_RECORDER_SIZE='{re.escape(bad)}' is not a "
                              r"number of entries \(0 or more; 0 turns the flight recorder off\): the recorder "
                              r"keeps the last 2000$"):
                recorder.configure()
            assert recorder.ring.maxlen == recorder.DEFAULT_SIZE
    finally:
        monkeypatch.delenv(recorder.ENV_SIZE)
        recorder.configure()
    assert recorder.ring.maxlen == recorder.DEFAULT_SIZE


def test_signal_handler_left_alone_when_the_program_has_one():
    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGUSR1, mine)
    try:
        assert flight_recorder.install_signal_handler() is False
        assert signal.getsignal(signal.SIGUSR1) is mine
        flight_recorder.remove_signal_handler()
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, old)


# -- analysis of hand-made dumps -----------------------------------------------------------------


def _dump(directory, rank, entries, world_size=3, reason="test"):
    d = {"version": 1, "rank": rank, "world_size": world_size, "pid": 100 + rank, "host": "h",
         "time": 1000.0, "reason": reason,
         "groups": [{"name": "g", "backend": "tcp", "ranks": list(range(world_size)), "rank": rank,
                     "size": world_size}],
         "entries": entries, "stacks": {}}
    (directory / f"rank{rank}.json").write_text(json.dumps(d))


def _e(seq, op, state, **kw):
    return {"group": "g", "seq": seq, "op": op, "state": state, "scheduled": 990.0, "started": 990.0,
            "finished": None if state in ("started", "scheduled") else 991.0, **kw}


def test_analysis_of_a_missing_dump_and_pending_p2p(tmp_path):
    ok = _e(1, "barrier", "completed")
    _dump(tmp_path, 0, [ok, _e(2, "all_reduce", "failed", error="DistTimeoutError: timed out"),
                        {**_e(None, "recv", "started"), "peer": 2, "tag": 7}])
    _dump(tmp_path, 1, [ok, _e(2, "all_reduce", "started")])
    report = analyze(str(tmp_path))
    text = report.text()
    assert report.missing == [2]
    assert "rank 2 wrote no dump, and ranks 0, 1 entered all_reduce (seq 2) on group 'g'" in text
    assert "rank 1 is stuck in all_reduce (seq 2) for 10.0 s" in text
    assert "rank 0 waits in recv from rank 2 (tag 7) on group 'g' for 10.0 s" in text
    assert "ranks 2 wrote no dump" not in text and "rank 2 wrote no dump: dead" in text


def test_analysis_when_everything_completed(tmp_path):
    for r in range(2):
        _dump(tmp_path, r, [_e(1, "barrier", "completed")], world_size=2)
    report = analyze(str(tmp_path))
    assert report.causes == [] and "nothing stuck or inconsistent" in report.text()
    assert any(f["kind"] == "ok" for f in report.findings)


def test_trace_analyze_command(tmp_path, capsys):
    _dump(tmp_path, 0, [_e(1, "all_reduce", "started", shape=[10], dtype="float32")], world_size=2)
    _dump(tmp_path, 1, [], world_size=2)
    (tmp_path / "junk.json").write_text("{")
    assert cli_main(["trace", "analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 1 never entered all_reduce (seq 1, shape (10,) float32)" in out
    assert "warning: cannot read junk.json" in out
    assert cli_main(["trace", "analyze", "--json", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["present"] == [0, 1] and any(f["kind"] == "never_entered" for f in data["findings"])
    assert cli_main(["trace", "analyze", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_each_rank_is_described_by_its_own_entry(tmp_path, capsys):
    ok = [_e(q, "all_reduce", "completed", shape=[8], dtype="float32", reduce_op="SUM") for q in (1, 2, 3)]
    _dump(tmp_path, 0, [*ok, _e(4, "all_reduce", "failed", shape=[1024], dtype="float32", reduce_op="SUM",
                                error="DistBackendError: rank 1 called barrier where this rank called all_reduce")],
          world_size=2)
    _dump(tmp_path, 1, [*ok, _e(4, "barrier", "failed", error="DistBackendError: rank 0 called all_reduce")],
          world_size=2)
    text = analyze(str(tmp_path)).text()
    assert "rank 0 failed in all_reduce (seq 4, shape (1024,) float32, SUM): DistBackendError" in text, text
    assert "rank 1 failed in barrier (seq 4): DistBackendError: rank 0 called all_reduce" in text, text
    assert "rank 1 failed in all_reduce" not in text, text
    assert cli_main(["trace", "analyze", "--json", str(tmp_path)]) == 0
    failed = {f["rank"]: f for f in json.loads(capsys.readouterr().out)["findings"] if f["kind"] == "failed"}
    assert failed[0]["op"] == "all_reduce" and failed[1]["op"] == "barrier", failed


def test_a_rank_with_another_shape_is_shown_with_its_own(tmp_path):
    for r in range(3):
        _dump(tmp_path, r, [_e(1, "all_reduce", "failed", shape=[20 if r == 1 else 10], dtype="float32",
                               reduce_op="SUM", error="DistBackendError: sizes differ")])
    report = analyze(str(tmp_path))
    text = report.text()
    assert "rank 1 failed in all_reduce (seq 1, shape (20,) float32, SUM)" in text, text
    assert "rank 2 failed in all_reduce (seq 1, shape (10,) float32, SUM)" in text, text
    assert "with different arguments" in report.causes[0], text


def _p2p(op, state, peer, tag, **kw):
    return {**_e(None, op, state, shape=[8], dtype="float32", **kw), "peer": peer, "tag": tag}


def test_failed_point_to_point_is_a_likely_cause(tmp_path):
    # rank 0 receives with tag 7, rank 1 sent with tag 8 then waits for an answer
    done = _e(1, "all_reduce", "completed")
    _dump(tmp_path, 0, [done, _p2p("recv", "failed", 1, 7, error="DistTimeoutError: recv waited 4 s for rank 1")],
          world_size=2)
    _dump(tmp_path, 1, [done, _p2p("send", "completed", 0, 8),
                        _p2p("recv", "failed", 0, 9, error="DistBackendError: rank 0 gave up on the group: ...")],
          world_size=2)
    report = analyze(str(tmp_path))
    text = report.text()
    assert "nothing stuck" not in text, text
    assert report.causes == ["rank 0's recv from rank 1 (tag 7) on group 'g' failed: DistTimeoutError: recv "
                             "waited 4 s for rank 1; rank 1's sends to it used tag 8"], text
    assert "rank 1's recv from rank 0 (tag 9) on group 'g' failed: DistBackendError: rank 0 gave up" in text, text


def test_pending_point_to_point_of_a_hang_is_a_likely_cause(tmp_path):
    done = _e(1, "all_reduce", "completed")
    _dump(tmp_path, 0, [done, _p2p("recv", "started", 1, 7)], world_size=2)
    _dump(tmp_path, 1, [done, _p2p("send", "completed", 0, 8), _p2p("recv", "started", 0, 9)], world_size=2)
    causes = analyze(str(tmp_path)).causes
    assert causes == ["rank 0 waits in recv from rank 1 (tag 7) on group 'g' for 10.0 s; rank 1's sends to it "
                      "used tag 8", "rank 1 waits in recv from rank 0 (tag 9) on group 'g' for 10.0 s"], causes


def _a2a(seq, rank, sends, recvs, state="completed"):
    return _e(seq, "all_to_all_single", state, shape=[sum(sends)], dtype="float32", send_counts=sends,
              recv_counts=recvs)


def test_uneven_all_to_all_is_no_mismatch_and_a_later_one_is_found(tmp_path):
    # rank r sends r + 1 elements to every rank (legitimate); then rank 1 calls broadcast first
    for r in range(3):
        later = [_e(2, "broadcast", "failed", root=0, error="x"), _e(3, "all_reduce", "scheduled")] if r == 1 else \
            [_e(2, "all_reduce", "failed", error="x"), _e(3, "broadcast", "scheduled", root=0)]
        _dump(tmp_path, r, [_a2a(1, r, [r + 1] * 3, [1, 2, 3]), *later])
    report = analyze(str(tmp_path))
    mismatches = [f for f in report.findings if f["kind"] == "mismatch"]
    assert [f["seq"] for f in mismatches] == [2], report.text()
    assert "all_reduce (seq 2) on ranks 0, 2 but broadcast (seq 2, root rank 0) on rank 1: the ranks issued " \
           "collectives in different orders" in report.causes[0], report.text()


def test_all_to_all_split_sizes_that_do_not_match_and_every_kind_of_mismatch(tmp_path):
    # seq 1: rank 0 sends rank 1 two elements, rank 1 expects one; seq 2: dtypes differ;
    # seq 3: shapes differ; seq 4: different collectives (later ones shifted: not reported)
    for r in range(2):
        _dump(tmp_path, r, [_a2a(1, r, [1, 2] if r == 0 else [1, 1], [1, 1]),
                            _e(2, "all_reduce", "completed", shape=[4], dtype="float32" if r else "int32"),
                            _e(3, "all_reduce", "completed", shape=[4 + r], dtype="float32"),
                            _e(4, "barrier" if r else "all_reduce", "failed", error="x"),
                            _e(5, "all_reduce" if r else "barrier", "scheduled")], world_size=2)
    report = analyze(str(tmp_path))
    mismatches = [f["text"] for f in report.findings if f["kind"] == "mismatch"]
    assert len(mismatches) == 4, report.text()
    assert "rank 0 sends 2 elements to rank 1, which expects 1 from it" in mismatches[0], mismatches
    assert "in different orders" in mismatches[3], mismatches
    assert len(report.causes) == 2, report.causes  # the first of each kind
    assert "rank 0 sends 2 elements" in report.causes[0] and "in different orders" in report.causes[1]


def test_ranks_that_disagree_on_a_group_are_reported(tmp_path):
    # rank 2 skipped new_group([0, 1]): its group '1:1' is [1, 2], rank 1's is [0, 1]
    def groups(views):
        return [{"name": name, "backend": "tcp", "ranks": ranks} for name, ranks in views.items()]
    ar = {"shape": [4], "dtype": "float32", "reduce_op": "SUM"}
    one = {"version": 1, "rank": 1, "world_size": 3, "time": 1000.0, "reason": "test", "stacks": {},
           "groups": groups({"1:1": [0, 1], "1:2": [1, 2]}),
           "entries": [{**_e(1, "all_reduce", "completed", **ar), "group": "1:1"},
                       {**_e(1, "all_reduce", "failed", error="DistTimeoutError: t", **ar), "group": "1:2"}]}
    two = {**one, "rank": 2, "groups": groups({"1:1": [1, 2]}),
           "entries": [{**_e(1, "all_reduce", "failed", error="DistTimeoutError: waiting for rank 0", **ar),
                        "group": "1:1"}]}
    for d in (one, two):
        (tmp_path / f"rank{d['rank']}.json").write_text(json.dumps(d))
    report = analyze(str(tmp_path))
    text = report.text()
    assert report.causes[0] == "the ranks disagree on the members of group '1:1' (rank 1: [0, 1]; rank 2: " \
                               "[1, 2]): they did not all create the same groups in the same order", text
    assert "rank 2 failed in all_reduce (seq 1, shape (4,) float32, SUM): DistTimeoutError: waiting for rank 0" \
           in text, text


def test_dumps_of_a_disabled_recorder_are_explained_by_their_broken_groups(tmp_path):
    broken = "DistTimeoutError: all_reduce (seq 4) on group 'g' timed out after 3 s: waiting for rank 1"
    for r in range(2):
        _dump(tmp_path, r, [], world_size=2, reason=f"group 'g' failed: {broken}")
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        d["recorder_size"] = 0
        d["groups"][0]["broken"] = broken if r == 0 else "DistBackendError: rank 0 gave up on the group: ..."
        (tmp_path / f"rank{r}.json").write_text(json.dumps(d))
    report = analyze(str(tmp_path))
    assert "nothing stuck" not in report.text(), report.text()
    assert report.causes == [f"group 'g' broke on ranks 0, 1, whose dumps record no operation (their flight "
                             f"recorder was off: DISTCOMM_FLIGHT_RECORDER_SIZE=0); the error: {broken}"], report.causes


def test_a_disabled_recorder_writes_no_dump_on_failure(tmp_path, monkeypatch):
    class Group:
        group_name = "g"

    monkeypatch.setenv(flight_recorder.ENV_DIR, str(tmp_path / "off"))
    try:
        recorder.configure(0)
        flight_recorder._on_failure(Group(), RuntimeError("boom"))
        assert not (tmp_path / "off").exists()
        assert dist.dump_flight_recorder(str(tmp_path / "asked")).endswith(".json")  # on request: still written
    finally:
        recorder.configure()
    flight_recorder._on_failure(Group(), RuntimeError("boom"))
    assert (tmp_path / "off").exists()


def test_where_a_rank_is_when_the_script_path_contains_distcomm(tmp_path):
    package = os.path.dirname(dist.__file__)
    assert flight_recorder.snapshot("x")["package_dir"] == package
    stack = ('  File "/home/u/distcomm/train.py", line 9, in <module>\n    step(model)\n'
             '  File "/home/u/distcomm/train.py", line 3, in step\n    time.sleep(60)\n'
             '  File "/opt/lib/distcomm/group.py", line 5, in barrier\n    wait()\n')
    _dump(tmp_path, 0, [_e(1, "barrier", "started")], world_size=2)
    _dump(tmp_path, 1, [], world_size=2)
    d = json.loads((tmp_path / "rank1.json").read_text())
    d.update(stacks={"MainThread (1)": stack}, package_dir="/opt/lib/distcomm")
    (tmp_path / "rank1.json").write_text(json.dumps(d))
    text = analyze(str(tmp_path)).text()
    assert 'it is at File "/home/u/distcomm/train.py", line 3, in step: time.sleep(60)' in text, text


def test_a_rank_whose_process_exited_is_said_dead(tmp_path):
    lost = "DistBackendError: lost connection to rank 1: its process exited or closed the connection"
    for r in (0, 2):
        _dump(tmp_path, r, [_e(1, "all_reduce", "completed"), _e(2, "all_reduce", "failed", error=lost)])
    report = analyze(str(tmp_path))
    text = report.text()
    assert "probably never entered" not in text, text
    assert report.causes == [f"rank 1 died (the errors say its process exited), and ranks 0, 2 entered all_reduce "
                             f"(seq 2) on group 'g' and failed; the error: {lost}"], text
    assert "rank 1 wrote no dump: its process exited" in text, text
