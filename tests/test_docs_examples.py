"""Every ```python block of README.md and docs/*.md runs, the way its first line says.

The first line of a block decides (docs/README.md tells writers the same):

* ``# run: COMMAND``: the block is written to a file and started with
  COMMAND, ``{file}`` standing for that file.  COMMAND is ``python {file}``,
  ``distcomm run [flags] {file}``, ``mpirun -n N python {file}`` or
  ``torchrun [flags] {file}``;
* ``# not run: REASON``: shown only (it needs two machines, or hangs on
  purpose); such blocks are counted and listed, and the reason is required;
* anything else: run as ``python {file}`` as rank 0 of a world of one
  (``RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR``, ``MASTER_PORT``), so a
  bare ``init_process_group()`` works.

A block passes when its command exits with status 0 within the time limit
and leaves no process behind; blocks check their own results with
``assert``.  docs/mpi.md's ``mpirun`` blocks and docs/torch.md's
``torchrun`` blocks are run by tests/test_mpi_backend.py and
tests/test_torch_backend.py, so not again here.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from distcomm.bench._coll_mpi import find_mpirun, mpi_missing
from distcomm.testing.leaks import pid_alive
from distcomm.testing.ranks import free_port

ROOT = Path(__file__).resolve().parent.parent
#: Seconds one block may take (a few seconds each on an idle 2-core machine).
BLOCK_TIMEOUT = 60.0
#: (doc, launcher) -> the test module that runs those blocks instead of this one.
ELSEWHERE = {
    ("docs/mpi.md", "mpirun"): "tests/test_mpi_backend.py",
    ("docs/torch.md", "torchrun"): "tests/test_torch_backend.py",
}
_FENCE = re.compile(r"^[ \t]*```(?:python3?|py)[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
#: Variables that tell a process it was started by a launcher: never inherited by an example.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "DISTCOMM_USE_AGENT_STORE", "DISTCOMM_STORE_PREFIX", "DISTCOMM_STORE_PORT",
                "DISTCOMM_RUN_ID", "DISTCOMM_HOST_ID", "DISTCOMM_AUTH_TOKEN")
_LAUNCH_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL")


@dataclass
class Block:
    where: str  # "docs/x.md:12", the line of the opening fence
    doc: str
    code: str
    kind: str  # "run", "plain", "not run", "elsewhere" or "bad"
    argv: list[str] = field(default_factory=list)  # with "{file}" still in it
    needs: str = ""  # "mpi" or "torch" when the command needs them
    why: str = ""  # the reason of "not run" / "bad" / "elsewhere"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks() -> list[Block]:
    """Every python block of the docs, classified by its first line."""
    found = []
    for path in doc_files():
        text = path.read_text()
        doc = path.relative_to(ROOT).as_posix()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(classify(f"{doc}:{line}", doc, textwrap.dedent(m.group(1))))
    return found


def classify(where: str, doc: str, code: str) -> Block:
    first = code.split("\n", 1)[0].strip()
    block = Block(where, doc, code, "plain", [sys.executable, "{file}"])
    if first.startswith("# not run:"):
        block.kind, block.argv, block.why = "not run", [], first[len("# not run:"):].strip()
        if not block.why:
            block.kind, block.why = "bad", "'# not run:' without a reason"
        return block
    if not first.startswith("# run:"):
        if re.match(r"#\s*(not\s+)?run\b", first, re.I):
            block.kind, block.why = "bad", f"malformed marker {first!r}"
        return block
    words = shlex.split(first[len("# run:"):])
    block.kind = "run"
    if "{file}" not in words:
        block.kind, block.why = "bad", f"'{first}' does not name {{file}}"
        return block
    head, rest = words[0], words[1:]
    if (doc, head) in ELSEWHERE:
        block.kind, block.why = "elsewhere", ELSEWHERE[(doc, head)]
    elif head == "python":
        block.argv = [sys.executable, *rest]
    elif head == "distcomm" and rest[:1] == ["run"]:
        block.argv = [sys.executable, "-m", "distcomm", "run", *rest[1:]]
    elif head == "mpirun":
        block.needs = "mpi"
        block.argv = ["mpirun", "--oversubscribe", *(sys.executable if w == "python" else w for w in rest)]
    elif head == "torchrun":
        block.needs = "torch"
        block.argv = [sys.executable, "-m", "torch.distributed.run", *rest]
    else:
        block.kind, block.why = "bad", f"no way to run {head!r} here (python, distcomm run, mpirun, torchrun)"
    return block


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if b.kind in ("run", "plain")]
#: Pages that teach by example: each must have at least one block that runs here.
PAGES_WITH_EXAMPLES = ("README.md", "docs/getting-started.md", "docs/migrating.md",
                       "docs/migrating-from-mpi4py.md", "docs/backends.md", "docs/store-protocol.md",
                       "docs/launcher.md")
#: "# not run" is for the few blocks CI cannot run (two machines, Slurm); more means misuse.
MAX_NOT_RUN = 3


def test_every_block_runs_here_or_says_why_not():
    bad = [f"{b.where}: {b.why}" for b in BLOCKS if b.kind == "bad"]
    assert not bad, "python blocks that neither run nor say why not:\n" + "\n".join(bad)
    counts = collections.Counter(b.kind for b in BLOCKS)
    without = [d for d in PAGES_WITH_EXAMPLES if not any(b.doc == d for b in RUNNABLE)]
    assert not without, f"no runnable example found in {without} (did the fence pattern break?)"
    for b in BLOCKS:
        if b.kind == "elsewhere":
            runner = (ROOT / b.why).read_text()
            assert Path(b.doc).name in runner, f"{b.where}: {b.why} does not read {b.doc}"
    not_run = [f"  {b.where}: {b.why}" for b in BLOCKS if b.kind == "not run"]
    print(f"{len(BLOCKS)} python blocks: {counts['run'] + counts['plain']} run here, "
          f"{counts['elsewhere']} by other tests, {len(not_run)} not run:", *not_run, sep="\n")
    assert len(not_run) <= MAX_NOT_RUN, "more blocks marked '# not run' than the few that need it:\n" + "\n".join(not_run)


@pytest.mark.parametrize("doc, first, kind", [
    ("docs/x.md", "# run: distcomm run --standalone --nproc-per-node 2 {file}", "run"),
    ("docs/x.md", "# run: mpirun -n 2 python {file}", "run"),
    ("docs/mpi.md", "# run: mpirun -n 2 python {file}", "elsewhere"),
    ("docs/x.md", "# run: srun -n 2 python {file}", "bad"),
    ("docs/x.md", "# run: python script.py", "bad"),
    ("docs/x.md", "# not run: needs two machines", "not run"),
    ("docs/x.md", "# not run:", "bad"),
    ("docs/x.md", "# Run: python {file}", "bad"),
    ("docs/x.md", "import distcomm", "plain"),
])
def test_first_lines_are_understood(doc, first, kind):
    assert classify(f"{doc}:1", doc, first + "\nprint()\n").kind == kind


def test_relative_links_resolve():
    broken = []
    for path in doc_files():
        for m in _LINK.finditer(path.read_text()):
            target = m.group(1)
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"
    assert "(docs/README.md)" in (ROOT / "README.md").read_text()


@pytest.mark.timeout(BLOCK_TIMEOUT + 30)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_block_runs(block: Block, tmp_path: Path):
    if block.needs == "mpi" and mpi_missing():
        pytest.skip(mpi_missing())
    if block.needs == "torch" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    script = tmp_path / "example.py"
    script.write_text(block.code)
    argv = [str(script) if w == "{file}" else w for w in block.argv]
    if block.needs == "mpi":
        argv[0] = find_mpirun()
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.update(PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if block.kind == "plain":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=BLOCK_TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"{block.where} still ran after {BLOCK_TIMEOUT:g} s ({shlex.join(argv)}); "
                    f"its output ends:\n{out[-3000:]}")
    left = _survivors(proc.pid)
    assert proc.returncode == 0, (f"{block.where} failed with exit status {proc.returncode} "
                                  f"({shlex.join(argv)}); its output ends:\n{out[-3000:]}")
    assert not left, f"{block.where} left processes behind: {left}"


def _survivors(session: int) -> list[str]:
    """Processes still in the example's session after it ended (killed now), described.

    Workers of ``distcomm run`` live in sessions of their own; they die with
    their launcher (a parent-death signal), which the launcher's tests check.
    """
    found: dict[int, str] = {}
    for _ in range(20):  # a launcher's children may take a moment to go after it
        found = {}
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                if os.getsid(pid) == session and pid_alive(pid):  # (an exited orphan waits for init)
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                continue
        if not found:
            return []
        time.sleep(0.1)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [f"{pid} {cmd}" for pid, cmd in found.items()]
