"""A launcher started by another one, wrappers between a launcher and Python, worlds of
the caller's own making: what ``env://`` and backend ``mpi`` take from the environment.

MPI is never initialised in the test process: the one path that could initialise it
(``init_process_group("mpi")``) runs in a subprocess with a faked environment.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap

import pytest
import test_env_detect
from test_env_detect import _PREFIXES

from distcomm import rendezvous
from distcomm.errors import DistRendezvousError
from distcomm.launch.environment import derived_port
from distcomm.store import TCPStore
from distcomm.testing import free_port

fake_env = test_env_detect.fake_env  # the fixture

#: Open MPI's variables for rank 1 of 4 on one host, without a job id (Open MPI 4 and 5
#: name the job in variables left out here: the port then derives from the launcher's pid).
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}




#: Kept from this process's environment: where failing ranks dump, the shm directory.
_KEEP = ("DISTCOMM_FLIGHT_RECORDER_DIR", "DISTCOMM_SHM_DIR")


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES) or k in _KEEP}
    return {**env, **extra}


def _run(cmd: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own; on timeout everything it started is killed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} still running after {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# -- backend 'mpi' in a process another launcher started inside an MPI job (fix 8) ---------

MPI_INIT = """
import sys
import distcomm as dist
from distcomm.errors import DistInputError
try:
    dist.init_process_group("mpi", timeout=20)
except DistInputError as e:
    print("refused:", e)
else:
    print("initialised: rank", dist.get_rank(), "of", dist.get_world_size())
    dist.destroy_process_group()
print("MPI imported:", "mpi4py.MPI" in sys.modules)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mpi", "launcher", "who", "names"),
    [
        # distcomm run (or torchrun) run by Open MPI's rank 0 of 1, giving its worker rank 1 of 2
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
         {"TORCHELASTIC_RUN_ID": "r1", "DISTCOMM_RUN_ID": "r1", "DISTCOMM_USE_AGENT_STORE": "1",
          "DISTCOMM_STORE_PREFIX": "run/r1/round0"},
         "distcomm run or torchrun", "Open MPI"),
        # distcomm.spawn run by Hydra's rank 0 of 1 (the PMI variables alone: Open MPI's libmpi
        # ignores them, so the old code initialised a singleton MPI job here)
        ({"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
         {"DISTCOMM_USE_AGENT_STORE": "1", "DISTCOMM_STORE_PREFIX": "spawn/abc"},
         "distcomm.spawn", "MPICH/Hydra"),
    ],
    ids=["open-mpi+distcomm-run", "hydra+spawn"],
)
def test_mpi_backend_refuses_a_worker_of_a_launcher_run_inside_an_mpi_job(tmp_path, mpi, launcher,
                                                                         who, names):
    """``init_process_group("mpi")`` in a process whose launcher gave it RANK/WORLD_SIZE 1 of 2
    but which inherited the MPI variables of that launcher's own process (MPI rank 0 of 1) is a
    DistInputError naming both ranks, the launcher and the MPI flavour, raised before MPI is
    initialised (mpi4py.MPI never imported)."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(MPI_INIT))
    env = _clean_env(**mpi, **launcher, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()),
                     # (should MPI be initialised after all, no shared-memory segment is left)
                     OMPI_MCA_btl="self")
    out = _run([sys.executable, str(prog)], env, str(tmp_path), timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: "), out.stdout + out.stderr
    text = lines[0]
    assert f"{who} started this process as rank 1 of 2" in text
    assert f"carries the {names} variables" in text and "(rank 0 of 1)" in text
    assert "mpirun -n 2" in text
    assert lines[1:] == ["MPI imported: False"]


LEFTOVER_IMPORT = """
from mpi4py import MPI  # a leftover import: MPI starts here, a world of this process alone
""" + MPI_INIT


@pytest.mark.timeout(90)
def test_mpi_backend_refuses_distcomm_run_workers_whose_mpi_world_is_their_own(tmp_path):
    """``distcomm run`` workers that import mpi4py.MPI before ``init_process_group("mpi")``
    are each a one-process MPI world (no MPI launcher started them): refused with the rank
    the launcher gave and MPI's, instead of every worker silently being rank 0 of 1."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(LEFTOVER_IMPORT))
    env = _clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                     OMPI_MCA_btl="self", PYTHONUNBUFFERED="1")
    out = _run([sys.executable, "-m", "distcomm.cli", "run", "--standalone", "--nproc-per-node",
                "2", str(prog)], env, str(tmp_path), timeout=80)
    assert out.returncode == 0, out.stdout + out.stderr
    refused = sorted(line for line in out.stdout.splitlines() if "refused: " in line)
    assert len(refused) == 2 and "initialised: rank" not in out.stdout, out.stdout + out.stderr
    for rank, line in enumerate(refused):
        assert f"distcomm run or torchrun started this process as rank {rank} of 2" in line
        assert "made it a world of its own (rank 0 of 1)" in line and "mpirun -n 2" in line


@pytest.mark.timeout(30)
def test_mpi_backend_lets_through_a_worker_whose_rank_is_mpis(fake_env):
    """The relaunch check passes a process whose RANK/WORLD_SIZE are the MPI job's own (a
    ``distcomm run`` per MPI rank, one worker each, numbered as MPI numbers them), and never
    initialises MPI to decide."""
    from distcomm.backends.mpi import _check_not_relaunched

    fake_env({**OMPI, "RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "r1",
              "DISTCOMM_RUN_ID": "r1", "DISTCOMM_USE_AGENT_STORE": "1"})
    had_mpi = "mpi4py.MPI" in sys.modules
    _check_not_relaunched()  # no error
    fake_env({"RANK": " 1", "WORLD_SIZE": "4 "})  # (surrounding spaces do not count)
    _check_not_relaunched()
    assert ("mpi4py.MPI" in sys.modules) == had_mpi


# -- the one-host MPI port through a wrapper shell (fix 1) ----------------------------------

PORT_PROG = "import os; from distcomm.launch.environment import detect; " \
            "i = detect(os.environ); print(i.source, i.master_addr, i.master_port, os.getppid())"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("names", "scheme", "source"),
    [(("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"), "ompi", "Open MPI"),
     (("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), "pmi", "MPICH/Hydra")],
    ids=["open-mpi", "hydra"],
)
def test_one_host_mpi_port_is_the_launchers_through_wrapper_shells(tmp_path, names, scheme, source):
    """Without a job id, ranks of one MPI job on one host derive the store port from the
    process that started them.  Three ranks started by this process (standing in for the MPI
    daemon), one directly and two through non-exec'ing ``sh -c`` wrappers (one and two
    deep) that carry the rank's variables, all derive the port from this process's pid."""
    py = f"{shlex.quote(sys.executable)} -c '{PORT_PROG}'"
    commands = [
        [sys.executable, "-c", PORT_PROG],
        ["sh", "-c", f"{py}; exit $?"],  # (a command after python: the shell cannot exec it)
        ["sh", "-c", f"sh -c \"{py}; exit \\$?\"; exit $?"],
    ]
    procs = []
    try:
        for rank, cmd in enumerate(commands):
            env = _clean_env(**dict(zip(names, (str(rank), "3", str(rank), "3"), strict=True)))
            procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        outputs = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # (the wrapper and the python it started)
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    found = [out.split() for out, _ in outputs]
    parents = [int(f[-1]) for f in found]
    assert parents[0] == os.getpid() and os.getpid() not in parents[1:]  # the wrappers are there
    port = derived_port(f"{scheme}:ppid{os.getpid()}")
    assert [f[:-1] for f in found] == [[*source.split(), "127.0.0.1", str(port)]] * 3


# -- torchrun started in a distcomm run worker (fix 3) --------------------------------------

DRIVER = """
import subprocess, sys
from datetime import timedelta
import numpy as np
import distcomm as dist
# a plain distcomm run worker: its group goes through the agent's store
dist.init_process_group(timeout=timedelta(seconds=30))
a = np.ones(1)
dist.all_reduce(a)
print(f"driver rank {dist.get_rank()} of {dist.get_world_size()} sum {a[0]}", flush=True)
dist.destroy_process_group()
rc = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", "2", "inner.py"])
print("inner exit code", rc, flush=True)
sys.exit(rc)
"""

INNER = """
import os
from datetime import timedelta
import numpy as np
import distcomm as dist
dist.init_process_group(timeout=timedelta(seconds=15))
a = np.ones(1)
dist.all_reduce(a)
line = f"inner rank {dist.get_rank()} of {dist.get_world_size()} sum {a[0]}"
os.write(1, (line + "\\n").encode())  # one write: the ranks share the launcher's stdout
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None,
                    reason="torch is not installed")
def test_torchrun_in_a_distcomm_run_worker_runs_a_job_of_its_own(tmp_path):
    """``distcomm run --nproc-per-node 1 driver.py``: the driver (a plain worker, its run ids
    equal) makes a group through the agent's store, then runs ``torchrun --nproc-per-node 2``
    of a distcomm program.  Its workers inherit the outer DISTCOMM_USE_AGENT_STORE /
    DISTCOMM_RUN_ID / DISTCOMM_STORE_PREFIX, but their TORCHELASTIC_RUN_ID is torchrun's: they
    are a torchrun job of 2 (not clients of the outer store, whose port is not
    MASTER_PORT) and their all_reduce sums 2."""
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    (tmp_path / "inner.py").write_text(textwrap.dedent(INNER))
    env = _clean_env(TMPDIR=str(tmp_path), LOGLEVEL="ERROR")  # torchrun's logs go to TMPDIR
    out = _run([sys.executable, "-m", "distcomm.cli", "run", "--standalone", "--nproc-per-node",
                "1", "driver.py"], env, str(tmp_path), timeout=100)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    lines = [line.split(":", 1)[-1] for line in out.stdout.splitlines()]  # ([rank0]: prefixes)
    assert "driver rank 0 of 1 sum 1.0" in lines, text
    assert sorted(line for line in lines if line.startswith("inner rank")) == [
        "inner rank 0 of 2 sum 2.0", "inner rank 1 of 2 sum 2.0"], text
    assert "inner exit code 0" in lines, text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("outer_kind", ["distcomm-run", "spawn"])
def test_agent_store_only_when_the_run_ids_are_the_agents(fake_env, outer_kind):
    """With the variables of a ``distcomm run`` worker (store at MASTER_PORT, prefix
    run/<id>/...) or of a ``distcomm.spawn`` child (prefix spawn/<id>), ``env://`` is a
    client of that store under the prefix while TORCHELASTIC_RUN_ID is the one the launcher
    gave; once a torchrun inside that process has set a run id of its own, it is torchrun's
    job: the store is distcomm's derived torchrun port, served by rank 0, and nothing
    reaches the outer store."""
    outer = TCPStore("127.0.0.1", 0, None, True, 10, wait_for_workers=False)
    try:
        if outer_kind == "spawn":
            prefix = "spawn/abc"
            own = {"DISTCOMM_STORE_PREFIX": prefix, "DISTCOMM_SPAWN_TORCHELASTIC_RUN_ID": ""}
        else:
            prefix = "run/outer/round0"
            own = {"DISTCOMM_RUN_ID": "outer", "DISTCOMM_STORE_PREFIX": prefix, "TORCHELASTIC_RUN_ID": "outer"}
        common = {"DISTCOMM_USE_AGENT_STORE": "1", "RANK": "0", "WORLD_SIZE": "1",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(outer.port)}
        fake_env({**common, **own})
        store, rank, size = next(rendezvous("env://", timeout=10))
        try:
            store.set("k", "plain")
        finally:
            store.close()
        assert (rank, size) == (0, 1)
        assert outer.get(f"{prefix}/k") == b"plain"

        fake_env({"TORCHELASTIC_RUN_ID": "inner", "TORCHELASTIC_USE_AGENT_STORE": "True",
                  "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        keys = outer.num_keys()
        store, rank, size = next(rendezvous("env://", timeout=10))
        try:
            store.set("k", "nested")
            port = getattr(store, "port", None)  # (a prefixed client of the outer store has none)
        finally:
            store.close()
        assert (rank, size) == (0, 1)
        assert outer.get(f"{prefix}/k") == b"plain" and outer.num_keys() == keys
        assert port == derived_port(f"torchrun:inner:{outer.port}") != outer.port
    finally:
        outer.close()


# -- LOCAL_RANK / LOCAL_WORLD_SIZE only for the launcher's own world (fix 6) ----------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("url", "launcher", "local"),
    [
        # srun/mpirun task 1 of 4 running a one-process job of its own (a sweep)
        ("env://?rank=0&world_size=1", OMPI, (None, None)),
        ("env://?rank=0&world_size=1", {**OMPI, "OMPI_COMM_WORLD_RANK": "0"}, (None, None)),
        # the launcher's own world, said again in the URL or not
        ("env://?rank=0&world_size=1", {**OMPI, "OMPI_COMM_WORLD_RANK": "0",
                                        "OMPI_COMM_WORLD_SIZE": "1",
                                        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                                        "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, ("0", "1")),
        ("env://", {**OMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
         ("0", "1")),
    ],
    ids=["other-world", "other-world-same-rank", "launchers-world-in-url", "launchers-world"],
)
def test_local_rank_is_set_only_for_the_launchers_own_world(fake_env, url, launcher, local):
    """``env://`` sets LOCAL_RANK / LOCAL_WORLD_SIZE from the launcher (as torchrun would)
    only when the world it joins is the launcher's; a rank and world size of the caller's
    own (rank=0&world_size=1 under an mpirun of 4) leave them unset."""
    fake_env({**launcher, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    store, rank, size = next(rendezvous(url, timeout=10))
    store.close()
    assert (rank, size) == (0, 1)
    assert (os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")) == local


# -- errors about a launcher's RANK name the launcher (fix 2) -------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("url", "extra", "size_said"),
    [
        ("env://?world_size=2", {}, "(world_size in the init_method URL)"),
        ("env://", {"OMPI_COMM_WORLD_RANK": "5"}, "(WORLD_SIZE (from Open MPI))"),
    ],
    ids=["size-from-url", "size-from-launcher"],
)
def test_rank_error_names_the_launcher_as_the_source(fake_env, url, extra, size_said):
    """A rank from Open MPI that is not below the world size is reported as
    ``RANK=... (from Open MPI)``, not as a RANK "in the environment" the user never set,
    and the error says where the world size came from."""
    fake_env({**OMPI, "OMPI_COMM_WORLD_RANK": "3", **extra, "MASTER_PORT": str(free_port())})
    rank = extra.get("OMPI_COMM_WORLD_RANK", "3")
    with pytest.raises(DistRendezvousError) as info:
        next(rendezvous(url, timeout=10))
    text = str(info.value)
    assert f"RANK={rank} (from Open MPI) is not below the world size" in text, text
    assert size_said in text, text
    assert "in the environment" not in text and "\n" not in text
    assert info.value.variable == "RANK"
