"""``distcomm run``'s ``[rankN]:`` lines: long lines, and unfinished lines of several ranks.

Each test runs the real launcher on worker programs written to ``tmp_path``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

RUN = [sys.executable, "-m", "distcomm.run", "--standalone"]
LINE = re.compile(rb"\[rank(\d+)\]:(.*)")


def write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def by_rank(out: bytes) -> dict[int, bytes]:
    """Each rank's text, its lines' texts joined in order; every line must carry one rank's text
    (the programs here write no empty lines)."""
    texts: dict[int, bytes] = {}
    assert out.endswith(b"\n"), out[-200:]
    for line in out[:-1].split(b"\n"):
        m = LINE.fullmatch(line)
        assert m is not None and m[2] and b"[rank" not in m[2], line[:200]
        texts[int(m[1])] = texts.get(int(m[1]), b"") + m[2]
    return texts


#: Rank r writes lines of letter r: 70000 and 100000 long (print), then 300000 long in one
#: write and its newline in another (the launcher cannot hold it all before the newline comes).
LONG_PROG = """
    import os, sys
    c = "abcdefgh"[int(os.environ["RANK"])]
    print(c * 70000)
    print(c * 100000)
    sys.stdout.write(c * 300000)
    sys.stdout.write("\\n")
    print("end", file=sys.stderr)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2])
def test_a_long_line_is_one_prefixed_line(tmp_path, n):
    prog = write(tmp_path, "long.py", LONG_PROG)
    out = subprocess.run([*RUN, "--nproc-per-node", str(n), prog], cwd=tmp_path, capture_output=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    if n == 1:  # alone on the console: each line whole, however it came through the pipe
        lines = sorted(out.stdout.splitlines(), key=len)
        assert [len(line) for line in lines] == [8 + k for k in (70000, 100000, 300000)]
        assert lines == [b"[rank0]:" + b"a" * k for k in (70000, 100000, 300000)]
    else:  # a part shown while the rest was late is ended by the other rank's output, and
        # the rest is a line of its own, prefixed again: each line holds one rank's text
        texts = by_rank(out.stdout)
        assert texts == {r: b"abcdefgh"[r : r + 1] * 470000 for r in range(n)}
    assert sorted(out.stderr.splitlines()) == [b"[rank%d]:end" % r for r in range(n)]


#: An endless line (256 MiB, no newline until the end); the wrapper prints what the launcher
#: wrote (bytes, newlines) and the most memory it (or its worker) used.
ENDLESS_PROG = """
    import os
    chunk = b"x" * 65536
    for _ in range(4096):
        os.write(1, chunk)
    os.write(1, b"\\n")
"""
MEASURE = """
    import resource, subprocess, sys
    job = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)
    size = lines = 0
    while chunk := job.stdout.read(1 << 20):
        size += len(chunk)
        lines += chunk.count(b"\\n")
    print(job.wait(), size, lines, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
"""


@pytest.mark.timeout(90)
def test_an_endless_line_is_passed_on_not_held(tmp_path):
    prog = write(tmp_path, "endless.py", ENDLESS_PROG)
    measure = write(tmp_path, "measure.py", MEASURE)
    with subprocess.Popen([sys.executable, measure, *RUN, "--nproc-per-node", "1", prog], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as job:
        try:
            out, err = job.communicate(timeout=80)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)  # the wrapper and the launcher (its worker follows the launcher)
            raise
    code, size, lines, max_rss_mib = map(int, out.split())
    assert (code, size, lines) == (0, len("[rank0]:") + (256 << 20) + 1, 1), err
    assert max_rss_mib < 128  # far less than the line: the launcher did not keep it


#: Each rank writes an unfinished line, waits until the test has seen both on the launcher's
#: output (``go`` exists), then ends it with argv[3].  argv[2][rank]: 0 stdout, 1 stderr.
SLOW_PROG = """
    import os, sys, time
    r = int(os.environ["RANK"])
    out = [sys.stdout, sys.stderr][int(sys.argv[2][r])]
    out.write(f"abc{r}")
    out.flush()
    while not os.path.exists(os.path.join(sys.argv[1], "go")):
        time.sleep(0.01)
    out.write(sys.argv[3] + "\\n")
    out.flush()
"""


def wait_for(fd: int, needles: list[bytes]) -> bytes:
    seen, deadline = b"", time.monotonic() + 30
    while not all(n in seen for n in needles) and time.monotonic() < deadline:
        data = os.read(fd, 4096)
        if not data:
            break
        seen += data
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["def", ""])
def test_unfinished_lines_of_two_ranks_stay_on_lines_of_their_own(tmp_path, end):
    prog = write(tmp_path, "slow.py", SLOW_PROG)
    logs = tmp_path / "logs"
    with subprocess.Popen([*RUN, "--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "3",
                           "--duplicate-stdout-filters", "abc", prog, str(tmp_path), "00", end],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as job:
        seen = wait_for(job.stdout.fileno(), [b"abc0", b"abc1"])  # shown before their lines end
        (tmp_path / "go").touch()
        out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert by_rank(seen + out) == {r: b"abc%d%s" % (r, end.encode()) for r in (0, 1)}
    (run,) = logs.iterdir()
    for r in (0, 1):  # the log files have the workers' bytes as they are
        assert (run / "attempt_0" / str(r) / "stdout.log").read_bytes() == b"abc%d%s\n" % (r, end.encode())
    kept = (run / "attempt_0" / "filtered_stdout.log").read_bytes().splitlines()
    assert sorted(kept) == [b"[rank%d]:abc%d%s" % (r, r, end.encode()) for r in (0, 1)]


@pytest.mark.timeout(60)
def test_stdout_and_stderr_on_one_pipe_keep_their_unfinished_lines_apart(tmp_path):
    prog = write(tmp_path, "slow.py", SLOW_PROG)
    with subprocess.Popen([*RUN, "--nproc-per-node", "2", prog, str(tmp_path), "01", "def"], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as job:
        seen = wait_for(job.stdout.fileno(), [b"abc0", b"abc1"])
        (tmp_path / "go").touch()
        out, _ = job.communicate(timeout=30)
    assert job.returncode == 0, seen + out
    assert by_rank(seen + out) == {0: b"abc0def", 1: b"abc1def"}


@pytest.mark.timeout(60)
def test_the_launchers_own_message_starts_a_line_of_its_own(tmp_path):
    prog = write(tmp_path, "prompt.py", """
        import os, sys, time
        sys.stdout.write("prompt> ")
        sys.stdout.flush()
        while not os.path.exists(os.path.join(sys.argv[1], "go")):
            time.sleep(0.01)
        sys.exit(3)
    """)
    with subprocess.Popen([*RUN, prog, str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as job:
        seen = wait_for(job.stdout.fileno(), [b"prompt> "])  # shown before the worker fails
        (tmp_path / "go").touch()
        out, _ = job.communicate(timeout=30)
    assert job.returncode == 1
    lines = (seen + out).decode().splitlines()
    assert lines[0] == "[rank0]:prompt> ", lines
    assert lines[1].startswith("distcomm run: rank 0 (local rank 0, pid "), lines
