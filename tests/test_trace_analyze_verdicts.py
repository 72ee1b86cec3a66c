"""``distcomm trace analyze``: the likely causes it gives for dumps that once misled it.

Fast and in-process: hand-written dumps in ``tmp_path``, modelled on real ones (a 3-rank tcp
run where rank 0 broadcast with another root; a hang dumped on SIGUSR1 with the flight
recorder off).
"""

from __future__ import annotations

import json

from distcomm.debug.analyze import analyze

AR = {"shape": [10], "dtype": "float32", "reduce_op": "SUM"}
CLASH = ("rank 0 called broadcast with root 0 where this rank called it with root 1 (group ranks, modulo "
         "255): the ranks' calls differ")


def _e(seq, op, state, error=None, **kw):
    e = {"group": "g", "seq": seq, "op": op, "state": state, "scheduled": 990.0, "started": 990.0,
         "finished": None if state in ("started", "scheduled") else 991.0, **kw}
    if error is not None:
        e["error"] = error
    return e


def _dump(directory, rank, entries, world_size=3, **kw):
    d = {"version": 1, "rank": rank, "world_size": world_size, "run_id": "r1", "pid": 100 + rank, "host": "h",
         "time": 1000.0, "reason": "test", "recorder_size": 2000, "package_dir": "/opt/lib/distcomm",
         "groups": [{"name": "g", "backend": "tcp", "ranks": list(range(world_size)), "rank": rank,
                     "size": world_size}],
         "entries": entries, "stacks": {}, **kw}
    (directory / f"rank{rank}.json").write_text(json.dumps(d))


def _causes(report, kind="cause"):
    return [f for f in report.findings if f["kind"] == kind and f["text"] in report.causes]


# -- a rank that completed a collective: every member entered it ----------------------------------


def test_an_error_that_names_the_cause_leads_and_a_rank_that_completed_is_no_failure(tmp_path):
    # The race the user met: rank 1 completed all_reduce (seq 1), then failed in broadcast (seq 2)
    # seeing rank 0 broadcast with root 0; rank 2, still finishing all_reduce (seq 1), was told
    # rank 1 gave up; rank 0 (a root: it only sends) exited without a dump.
    relayed = f"DistBackendError: rank 1 gave up on the group: broadcast (seq 2) on group 'g' failed on rank 1: {CLASH}"
    _dump(tmp_path, 1, [_e(1, "all_reduce", "completed", **AR),
                        _e(2, "broadcast", "failed", f"DistBackendError: {CLASH}", shape=[10], dtype="float32",
                           root=1)])
    _dump(tmp_path, 2, [_e(1, "all_reduce", "failed", relayed, **AR)])
    report = analyze(str(tmp_path))
    text = report.text()
    assert report.missing == [0], text
    assert report.causes == ["rank 0 called broadcast with root 0 where rank 1 called it with root 1 (group ranks, "
                             "modulo 255): the ranks' calls differ (on group 'g', as rank 2's error in all_reduce "
                             "(seq 1, shape (10,) float32, SUM) says)"], text
    assert _causes(report)[0]["ranks"] == [0, 1]
    assert "probably never entered" not in text and "ranks 1, 2 entered" not in text, text
    assert "rank 2 failed in all_reduce (seq 1, shape (10,) float32, SUM)" in text, text
    assert "rank 1 completed all_reduce (seq 1, shape (10,) float32, SUM)" in text, text
    assert "rank 0 wrote no dump (it must have entered this collective: rank 1 completed it)" in text, text
    assert "rank 2 (pid 102 on h, " in text and ", 1 entry): test" in text, text  # not "1 entries"


def test_the_cause_an_error_names_when_only_one_rank_wrote_a_dump(tmp_path):
    # the same run where ranks 0 and 1 (both roots) exited before they learnt of it
    _dump(tmp_path, 2, [_e(1, "all_reduce", "completed", **AR),
                        _e(2, "broadcast", "failed", f"DistBackendError: {CLASH}", shape=[10], dtype="float32",
                           root=1)])
    report = analyze(str(tmp_path))
    text = report.text()
    assert report.causes == ["rank 0 called broadcast with root 0 where rank 2 called it with root 1 (group ranks, "
                             "modulo 255): the ranks' calls differ (on group 'g', as rank 2's error in broadcast "
                             "(seq 2, shape (10,) float32, root rank 1) says)"], text
    assert "probably never entered" not in text, text


def test_a_rank_without_dump_is_not_said_absent_from_a_collective_another_completed(tmp_path):
    timeout = "DistTimeoutError: timed out after 5 s waiting for rank 1"
    _dump(tmp_path, 1, [_e(1, "all_reduce", "completed", **AR)])
    _dump(tmp_path, 2, [_e(1, "all_reduce", "failed", timeout, **AR)])
    report = analyze(str(tmp_path))
    text = report.text()
    assert report.causes == [f"all_reduce (seq 1, shape (10,) float32, SUM) on group 'g' failed on rank 2, which "
                             f"rank 1 completed: {timeout}"], text
    assert "probably never entered" not in text, text


def test_a_broadcast_completed_by_its_root_says_nothing_of_the_others(tmp_path):
    # root 1 only sends: its completing says nothing of rank 0, which probably never came
    timeout = "DistTimeoutError: timed out after 5 s waiting for rank 0"
    bc = {"shape": [10], "dtype": "float32", "root": 1}
    _dump(tmp_path, 1, [_e(1, "broadcast", "completed", **bc)])
    _dump(tmp_path, 2, [_e(1, "broadcast", "failed", timeout, **bc)])
    report = analyze(str(tmp_path))
    assert report.causes == ["rank 0 wrote no dump, and ranks 1, 2 entered broadcast (seq 1, shape (10,) float32, "
                             "root rank 1) on group 'g' (rank 2 failed, rank 1 completed it): rank 0 probably never "
                             f"entered it (dead, or stuck elsewhere); the error: {timeout}"], report.text()
    # a rank other than the root completed it: the root (rank 0) entered it
    bc["root"] = 0
    _dump(tmp_path, 1, [_e(1, "broadcast", "completed", **bc)])
    _dump(tmp_path, 2, [_e(1, "broadcast", "started", **bc)])
    report = analyze(str(tmp_path))
    assert report.causes == ["rank 2 is stuck in broadcast (seq 1, shape (10,) float32, root rank 0) on group 'g', "
                             "which rank 1 completed"], report.text()


# -- the flight recorder off: the stacks tell where each rank is ----------------------------------


def _stack(*frames):
    return "".join(f'  File "{path}", line {line}, in {fn}\n    {code}\n' for path, line, fn, code in frames)


SIGNAL = [("/opt/lib/distcomm/debug/flight_recorder.py", 200, "_on_signal", 'path = dump_flight_recorder("SIGUSR1")'),
          ("/opt/lib/distcomm/debug/flight_recorder.py", 161, "snapshot", '"stacks": _stacks(),')]
IN_ALL_REDUCE = [("/home/u/hang.py", 11, "<module>", "dist.all_reduce(x)"),
                 ("/opt/lib/distcomm/collectives.py", 117, "all_reduce", "return _ret(pg.allreduce(tensor))"),
                 ("/opt/lib/distcomm/transport/tcp.py", 1390, "_pump", "events = poller.poll(100)"), *SIGNAL]
SLEEPING = [("/home/u/hang.py", 10, "<module>", "time.sleep(30)"), *SIGNAL]


def test_dumps_of_a_disabled_recorder_point_at_the_stacks(tmp_path):
    # DISTCOMM_FLIGHT_RECORDER_SIZE=0, every rank dumped on SIGUSR1: rank 1 sleeps, the others wait
    for r in range(3):
        _dump(tmp_path, r, [], reason="SIGUSR1", recorder_size=0,
              stacks={"distcomm-tcp-progress:0 (7)": _stack(("/usr/lib/python3.11/threading.py", 982, "run", "x")),
                      f"MainThread ({r})": _stack(*(SLEEPING if r == 1 else IN_ALL_REDUCE))})
    report = analyze(str(tmp_path))
    text = report.text()
    assert "nothing stuck or inconsistent" not in text, text
    assert report.causes[0].startswith("the flight recorder was off on ranks 0, 1, 2 "
                                       "(DISTCOMM_FLIGHT_RECORDER_SIZE=0): their dumps record no operation, so the "
                                       "analysis cannot tell which collective is stuck"), text
    assert "unset DISTCOMM_FLIGHT_RECORDER_SIZE" in report.causes[0], text
    assert report.causes[1] == ("from the stacks: ranks 0, 2 are in distcomm's all_reduce; rank 1 is outside "
                                'distcomm, at File "/home/u/hang.py", line 10, in <module>: time.sleep(30)'), text
    assert len(report.causes) == 2, text
    assert 'rank 0 is in distcomm\'s all_reduce, called at File "/home/u/hang.py", line 11, in <module>: ' \
           "dist.all_reduce(x)" in text, text
    assert "ranks 0, 1, 2 recorded no operation (their flight recorder was off)" in text, text
    assert "0 entries, recorder off" in text, text


def test_a_rank_whose_recorder_was_off_is_not_said_to_have_missed_a_collective(tmp_path):
    _dump(tmp_path, 0, [_e(1, "all_reduce", "completed", **AR), _e(2, "all_reduce", "started", **AR)], world_size=2)
    _dump(tmp_path, 1, [], world_size=2, reason="SIGUSR1", recorder_size=0,
          stacks={"MainThread (1)": _stack(*SLEEPING)})
    report = analyze(str(tmp_path))
    text = report.text()
    assert "never entered" not in text, text
    assert report.causes == ["rank 0 is stuck in all_reduce (seq 2, shape (10,) float32, SUM) on group 'g'"], text
    assert "rank 1 recorded no operation (its flight recorder was off)" in text, text
    assert 'rank 1 is outside distcomm, at File "/home/u/hang.py", line 10, in <module>: time.sleep(30)' in text, text
