"""``distcomm trace analyze`` on bad input: malformed dumps, no dump at all, a file instead of a directory.

Fast and in-process: hand-written dumps in ``tmp_path``, the CLI through ``distcomm.cli.main``.
"""

from __future__ import annotations

import json
import os

import pytest

from distcomm.cli import main as cli_main
from distcomm.debug.analyze import MAX_WORLD_SIZE, analyze


def _entry(seq, op="all_reduce", state="completed", **kw):
    return {"group": "g", "seq": seq, "op": op, "state": state, "scheduled": 990.0, "started": 990.0,
            "finished": None if state in ("started", "scheduled") else 991.0, **kw}


def _dump(rank, entries, world_size=2, **kw):
    return {"version": 1, "rank": rank, "world_size": world_size, "pid": 100 + rank, "host": "h",
            "time": 1000.0, "reason": "test",
            "groups": [{"name": "g", "backend": "tcp", "ranks": [0, 1], "rank": rank,
                        "size": world_size}],
            "entries": entries, "stacks": {}, **kw}


def _write(directory, name, content):
    (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))


def _good(directory):
    """rank0.json: rank 0 waits in all_reduce seq 2."""
    _write(directory, "rank0.json", _dump(0, [_entry(1), _entry(2, state="started")]))


def _run(capsys, *args):
    rc = cli_main(["trace", "analyze", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


GOOD_TEXT = "rank 0 is stuck in all_reduce (seq 2) for 10.0 s"

BAD = {  # rank1.json's content -> what the warning says is wrong with it
    "entry_without_group": (_dump(1, [{}]), "entries[0] has no 'group'"),
    "fourth_entry_without_group": (_dump(1, [_entry(1), _entry(2), _entry(3), {"seq": 4, "op": "barrier",
                                                                               "state": "started"}]),
                                   "entries[3] has no 'group'"),
    "entries_not_a_list": (_dump(1, "x"), "'entries' is \"x\", not a list"),
    "entry_not_an_object": (_dump(1, [7]), "entries[0] is 7, not an object"),
    "seq_not_a_number": (_dump(1, [_entry("one")]), "entries[0]: 'seq' is \"one\", not a sequence number"),
    "shape_not_sizes": (_dump(1, [_entry(1, shape="big")]), "entries[0]: 'shape' is \"big\""),
    "time_not_a_number": (_dump(1, [], time="noon"), "'time' is \"noon\", not a time in seconds"),
    "time_nan": ('{"rank": 1, "world_size": 2, "time": NaN}', "'time' is NaN"),
    "started_not_a_number": (_dump(1, [_entry(1, state="started", started="x")]), "entries[0]: 'started' is"),
    "group_without_name": (_dump(1, [], groups=[{"ranks": [0]}]), "groups[0] has no 'name'"),
    "group_ranks_not_ranks": (_dump(1, [], groups=[{"name": "g", "ranks": "01"}]),
                              "groups[0]: 'ranks' is \"01\", not a list of ranks"),
    "huge_world_size": (_dump(1, [], world_size=10**12),
                        f"'world_size' is 1000000000000, not a number of ranks from 1 to {MAX_WORLD_SIZE}"),
    "zero_world_size": (_dump(1, [], world_size=0), "'world_size' is 0"),
    "rank_outside_the_world": (_dump(1, [], world_size=1), "'rank' is 1, not a rank from 0 to 0"),
    "rank_not_an_int": ({**_dump(1, []), "rank": "1"}, "'rank' is \"1\""),
    "no_rank": ({**_dump(1, []), "rank": None}, "the dump has no rank"),
    "no_world_size": ({**_dump(1, []), "world_size": None}, "the dump has no 'world_size'"),
    "stacks_not_text": (_dump(1, [], stacks={"MainThread (1)": 5}), "'stacks' is"),
    "not_an_object": ("[1, 2]", "not a dump: the file holds [1, 2], not a JSON object"),
    "too_deeply_nested": ("[" * 100000 + "]" * 100000, ""),  # RecursionError in json: still a warning
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_dump_is_skipped_and_the_others_analysed(case, tmp_path, capsys):
    content, problem = BAD[case]
    _good(tmp_path)
    _write(tmp_path, "rank1.json", content)
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0, err
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: cannot read rank1.json: {problem}"), out
    assert GOOD_TEXT in out and "dumps from rank 0; missing: rank 1" in out, out


def test_malformed_dump_listed_in_json_errors(tmp_path, capsys):
    _good(tmp_path)
    _write(tmp_path, "rank1.json", _dump(1, [{}]))
    rc, out, _ = _run(capsys, "--json", tmp_path)
    data = json.loads(out)
    assert rc == 0 and data["present"] == [0] and data["missing"] == [1]
    assert data["errors"] == ["cannot read rank1.json: entries[0] has no 'group'"]
    assert any(f["kind"] == "stuck" and f["rank"] == 0 for f in data["findings"])


def test_null_lists_and_missing_optional_fields_are_read(tmp_path, capsys):
    _good(tmp_path)
    _write(tmp_path, "rank1.json", {"rank": 1, "world_size": 2, "entries": None, "groups": None, "stacks": None})
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0, err
    assert "dumps from ranks 0, 1" in out and "warning" not in out, out
    assert "rank 1 never entered all_reduce (seq 1)" in out, out


def test_dumps_that_disagree_do_not_crash_the_analysis(tmp_path):
    # both ranks recorded seq 1 and 3 but not 2; rank 1 names a root outside the 2-rank group
    for r in range(2):
        _write(tmp_path, f"rank{r}.json", _dump(r, [_entry(1), _entry(3)]))
    report = analyze(str(tmp_path))
    assert report.causes == [] and report.errors == [], report.text()
    _write(tmp_path, "rank1.json", _dump(1, [_entry(1), _entry(3), _entry(4, op="broadcast", state="started",
                                                                          root=5)]))
    _write(tmp_path, "rank0.json", _dump(0, [_entry(1), _entry(3), {**_entry(None, op="recv", state="started"),
                                                                    "peer": 9, "tag": 0}]))
    text = analyze(str(tmp_path)).text()
    assert "rank 1 is stuck in broadcast (seq 4, root rank 5)" in text, text
    assert "rank 0 waits in recv from rank 9" in text, text


def test_empty_directory_exits_1(tmp_path, capsys):
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 1 and out == ""
    assert err.splitlines() == [f"distcomm trace analyze: no readable dump in {tmp_path} "
                                "(expected the flight recorder's rank<R>.json files)"]


def test_only_unreadable_dumps_exits_1_with_their_warnings(tmp_path, capsys):
    _write(tmp_path, "rank0.json", "{")
    _write(tmp_path, "rank1.json", _dump(1, "x"))
    rc, out, err = _run(capsys, tmp_path)
    lines = err.splitlines()
    assert rc == 1 and out == "", out
    assert lines[0].startswith("warning: cannot read rank0.json: ")
    assert lines[1] == "warning: cannot read rank1.json: 'entries' is \"x\", not a list"
    assert lines[2].startswith(f"distcomm trace analyze: no readable dump in {tmp_path} ") and len(lines) == 3
    rc, out, err = _run(capsys, "--json", tmp_path)
    assert rc == 1 and json.loads(out)["present"] == [] and "no readable dump" in err


def test_a_dump_file_instead_of_its_directory(tmp_path, capsys):
    _good(tmp_path)
    rc, out, err = _run(capsys, tmp_path / "rank0.json")
    assert rc == 2 and out == ""
    assert err.splitlines() == [f"distcomm trace analyze: {tmp_path / 'rank0.json'}: a dump file, not a directory: "
                                f"pass the directory holding every rank's dump (distcomm trace analyze {tmp_path})"]
    (tmp_path / "notes.txt").write_text("hello")
    rc, out, err = _run(capsys, tmp_path / "notes.txt")
    assert rc == 2 and err.strip() == f"distcomm trace analyze: {tmp_path / 'notes.txt'}: not a directory"
    rc, out, err = _run(capsys, tmp_path / "nope")
    assert rc == 2 and err.strip() == f"distcomm trace analyze: {tmp_path / 'nope'}: no such directory"


def test_dumps_of_another_run_are_left_out(tmp_path, capsys):
    # rank1.json is left from an earlier run in the same directory
    _write(tmp_path, "rank0.json", _dump(0, [_entry(1), _entry(2, state="started")], run_id="new", time=2000.0))
    _write(tmp_path, "rank1.json", _dump(1, [_entry(1, op="broadcast", state="failed")], run_id="old"))
    _write(tmp_path, "rank0-copy.json", _dump(0, [], run_id="new", time=1500.0))
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0, err
    assert "dumps from rank 0; missing: rank 1" in out and GOOD_TEXT.replace("10.0", "1010.0") in out, out
    assert "broadcast" not in out, out
    assert "warning: left out rank1.json: it is from another run (run id old, written " in out, out
    assert "than the newest dumps (run id new)" in out, out
    assert "warning: left out rank0-copy.json: rank0.json is a newer dump of rank 0" in out, out


def test_dumps_of_an_earlier_round_of_the_run_are_left_out(tmp_path, capsys):
    # a restart (--max-restarts): rank1.json is from the first generation of the same run id
    _write(tmp_path, "rank0.json", _dump(0, [_entry(1), _entry(2, state="started")], run_id="r", round=1,
                                         time=2000.0))
    _write(tmp_path, "rank1.json", _dump(1, [_entry(1, op="broadcast", state="failed")], run_id="r", round=0))
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0, err
    assert "dumps from rank 0; missing: rank 1" in out, out
    assert "broadcast" not in out, out
    assert "warning: left out rank1.json: it is from an earlier round of the run (round 0, written " in out, out


def test_dumps_of_an_earlier_job_with_the_same_run_id_are_left_out(tmp_path, capsys):
    # `distcomm run --rdzv-id r` twice: the same run id and round, another initialisation
    _write(tmp_path, "rank0.json", _dump(0, [_entry(1), _entry(2, state="started")], run_id="r", round=0,
                                         instance="second", time=2000.0))
    _write(tmp_path, "rank1.json", _dump(1, [_entry(1, op="broadcast", state="failed")], run_id="r", round=0,
                                         instance="first"))
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0, err
    assert "dumps from rank 0; missing: rank 1" in out, out
    assert "broadcast" not in out, out
    assert "warning: left out rank1.json: it is from an earlier job with the same run id r (written " in out, out


def test_a_stray_file_with_a_rank_outside_the_world_is_skipped(tmp_path, capsys):
    # a 2-rank run's dumps, and a file that only names a rank
    _good(tmp_path)
    _write(tmp_path, "rank1.json", _dump(1, [_entry(1), _entry(2, state="started")]))
    _write(tmp_path, "rank5.json", {"rank": 5})
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0, err
    assert "2 ranks; dumps from ranks 0, 1\n" in out and "rank 5" not in out.replace("rank5.json", ""), out
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: cannot read rank5.json: the dump has no 'world_size' (not a flight-recorder "
                        "dump?)"], out
    # one that gives a world of its own is left out too, whichever is newer
    _write(tmp_path, "rank5.json", {"rank": 5, "world_size": 8, "time": 3000.0})
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0 and "2 ranks; dumps from ranks 0, 1\n" in out, out
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: left out rank5.json: it says the world has 8 ranks where the other dumps say 2"], out


def test_a_fifo_named_like_a_dump_is_skipped_not_waited_on(tmp_path, capsys):
    """open() of a FIFO blocks until a writer comes: the analysis would wait for ever."""
    _good(tmp_path)
    os.mkfifo(tmp_path / "rank1.json")
    rc, out, err = _run(capsys, tmp_path)
    assert rc == 0, err
    assert "warning: cannot read rank1.json: not a regular file" in out, out
    assert GOOD_TEXT in out
