"""Started by someone else: torchrun, Open MPI, MPICH/Hydra and Slurm environments.

Each environment module is checked with a faked environment; ``env://``
rendezvous is checked end to end with a faked single-process job; and, when
available, a real ``mpirun -n 2`` and a real torchrun run a distcomm program
that calls ``init_process_group()`` with no arguments.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from distcomm import rendezvous
from distcomm.errors import DistInputError, DistNetworkError, DistRendezvousError
from distcomm.launch import env_mpich, env_openmpi, env_slurm, env_torchrun
from distcomm.launch.environment import DERIVED_PORT_RANGE, LaunchInfo, derived_port, detect
from distcomm.launch.hostlist import expand_hostlist, first_host
from distcomm.testing import free_port

pytestmark = pytest.mark.timeout(60)

_PREFIXES = ("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_",
             "DISTCOMM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_")

OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "PMIX_NAMESPACE": "prterun-host-123@1"}
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
         "PMI_KVSNAME": "kvs_77_0"}
SLURM = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
         "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_JOB_ID": "4242",
         "SLURM_STEP_NODELIST": "node[07-09,11]", "SLURM_STEP_TASKS_PER_NODE": "3(x2),1,1"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "3",
            "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0",
            "MASTER_PORT": "29400"}


@pytest.fixture
def fake_env(monkeypatch):
    """Clear every launcher variable (restored afterwards); return a setter."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES):
            monkeypatch.delenv(name)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # rendezvous may set these: restore them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def set_env(values: dict[str, str]) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_env


# -- host lists -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a,b,c", ["a", "b", "c"]),
        ("single", ["single"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("rack[1-2]-gpu[0-1].cluster", ["rack1-gpu0.cluster", "rack1-gpu1.cluster",
                                        "rack2-gpu0.cluster", "rack2-gpu1.cluster"]),
    ],
)
def test_hostlist_forms(text, hosts):
    assert list(expand_hostlist(text)) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text", ["n[1-", "n1]", "n[3-1]", "n[a-b]", "n[[1]]", ""])
def test_bad_hostlists(text):
    with pytest.raises(DistInputError):
        first_host(text)


def test_first_host_of_a_huge_list_is_cheap():
    assert first_host("n[000000-999999]") == "n000000"


def test_slurm_tasks_per_node():
    assert [env_slurm.tasks_on_node("3(x2),1,1", i) for i in range(5)] == [3, 3, 1, 1, None]
    assert env_slurm.tasks_on_node("garbage", 0) is None


# -- each environment, faked --------------------------------------------------------------


def test_derived_ports_are_stable_high_and_spread():
    ports = {derived_port(f"slurm:{job}.0") for job in range(1000)}
    assert all(DERIVED_PORT_RANGE[0] <= p < DERIVED_PORT_RANGE[1] for p in ports)
    assert len(ports) > 800
    assert derived_port("x") == derived_port("x")


def test_torchrun():
    assert env_torchrun.present(TORCHRUN) and not env_torchrun.present({"RANK": "0"})
    info = env_torchrun.info(TORCHRUN)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert (info.master_addr, info.master_port) == ("h0", 29400)
    # MASTER_PORT is torch's own store: distcomm's goes elsewhere, the same for every worker
    assert info.store_port == derived_port("torchrun:abc:29400") != 29400
    assert env_torchrun.info({**TORCHRUN, "DISTCOMM_STORE_PORT": "12345"}).store_port == 12345
    assert env_torchrun.info({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}).store_port is None


def test_open_mpi():
    assert env_openmpi.present(OMPI) and detect(OMPI).source == "Open MPI"
    info = env_openmpi.info(OMPI)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 4, 1, 4)
    assert info.master_addr == "127.0.0.1"  # every rank on this host
    assert info.master_port == derived_port("ompi:prterun-host-123@1")
    several_hosts = env_openmpi.info({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert several_hosts.master_addr is None and "mpirun -x MASTER_ADDR" in several_hosts.hint
    # Open MPI 4 names its job differently; without any job id one host still agrees (parent pid)
    assert env_openmpi.info({**OMPI, "PMIX_NAMESPACE": "", "OMPI_MCA_ess_base_jobid": "9"}) \
        .master_port == derived_port("ompi:9")
    assert env_openmpi.info({**OMPI, "PMIX_NAMESPACE": ""}).master_port == \
        derived_port(f"ompi:ppid{os.getppid()}")


def test_mpich_hydra():
    assert env_mpich.present(HYDRA) and detect(HYDRA).source == "MPICH/Hydra"
    info = env_mpich.info(HYDRA)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (2, 3, 0, 1)
    assert info.master_addr is None and "MASTER_ADDR" in info.hint  # ranks on several hosts
    assert info.master_port == derived_port("pmi:kvs_77_0")
    one_host = env_mpich.info({**HYDRA, "MPI_LOCALNRANKS": "3", "PMI_KVSNAME": ""})
    assert one_host.master_addr == "127.0.0.1"
    assert one_host.master_port == derived_port(f"pmi:ppid{os.getppid()}")


def test_slurm():
    assert env_slurm.present(SLURM) and detect(SLURM).source == "Slurm"
    info = env_slurm.info(SLURM)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 1)
    assert info.master_addr == "node07"
    assert info.master_port == derived_port("slurm:4242.0")
    job_list = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert env_slurm.info({**job_list, "SLURM_JOB_NODELIST": "gpu5,cpu[1-2]"}).master_addr == "gpu5"


@pytest.mark.parametrize(
    "extra, source",
    [
        ({"SLURM_STEP_ID": ""}, None),  # a batch script, not a step: not a rank
        (OMPI, "Open MPI"),  # mpirun inside an allocation
        ({"PMI_RANK": "0", "PMI_SIZE": "3"}, "MPICH/Hydra"),  # Hydra inside an allocation
        ({"PMI_RANK": "5", "PMI_SIZE": "8"}, "Slurm"),  # srun --mpi=pmi2 agrees with Slurm
        (TORCHRUN, "torchrun"),
    ],
)
def test_which_launcher_wins(extra, source):
    found = detect({**SLURM, **extra})
    assert (found.source if found else None) == source


def test_nothing_detected():
    assert detect({"HOME": "/root"}) is None


def test_malformed_launcher_variable_names_it():
    with pytest.raises(DistRendezvousError, match=r"SLURM_PROCID='x' \(set by Slurm\)") as info:
        detect({**SLURM, "SLURM_PROCID": "x"})
    assert info.value.variable == "SLURM_PROCID"


# -- env:// with a faked environment ------------------------------------------------------


def _meet(env_values: dict[str, str], fake_env) -> tuple:
    fake_env(env_values)
    store, rank, size = next(rendezvous("env://", timeout=10))
    try:
        store.set("k", "v")
        return rank, size, store.port, store.get("k")
    finally:
        store.close()


def test_env_rendezvous_under_fake_open_mpi(fake_env):
    env = {**OMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert _meet(env, fake_env) == (0, 1, derived_port("ompi:prterun-host-123@1"), b"v")
    assert os.environ["LOCAL_RANK"] == "0" and os.environ["LOCAL_WORLD_SIZE"] == "1"


def test_env_rendezvous_under_fake_slurm(fake_env):
    env = {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
           "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0"}
    assert _meet(env, fake_env) == (0, 1, derived_port("slurm:4242.0"), b"v")


def test_env_rendezvous_under_fake_torchrun_avoids_torchs_store(fake_env):
    env = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert _meet(env, fake_env) == (0, 1, derived_port("torchrun:abc:29400"), b"v")


def test_explicit_master_variables_win_over_the_launcher(fake_env):
    port = free_port()
    env = {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "1", "RANK": "0"}
    assert _meet(env, fake_env) == (0, 1, port, b"v")


@pytest.mark.parametrize(("name", "value", "said"), [("WORLD_SIZE", "1", "world size 8"),
                                                     ("RANK", "0", "rank 5")])
def test_rank_or_size_in_the_environment_contradicting_the_launcher_is_an_error(fake_env, name, value,
                                                                                said):
    """A RANK or WORLD_SIZE left over in the environment (an export in the shell) would run
    each srun task as a job of its own, silently: both values are named instead."""
    fake_env({**SLURM, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), name: value})
    with pytest.raises(DistRendezvousError) as info:
        next(rendezvous("env://"))
    text = str(info.value)
    assert f"{name}={value} in the environment, but Slurm started this process with {said}" in text
    assert "\n" not in text and info.value.variable == name


def test_a_derived_port_someone_holds_says_where_it_came_from(fake_env):
    """Two jobs whose ids hash alike share a derived port: the second's error says the port
    was derived and how to choose one."""
    import socket

    env = {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1"}
    port = detect(env).master_port
    with socket.create_server(("127.0.0.1", port)):
        fake_env(env)
        with pytest.raises(DistNetworkError) as info:
            next(rendezvous("env://", timeout=5))
    text = str(info.value)
    assert f"port {port} is derived from the job id Slurm gave" in text and "set MASTER_PORT" in text, text


def test_workers_a_program_started_beneath_a_one_process_launcher_keep_their_world(fake_env):
    """srun -n 1 (or mpirun -n 1) running a program that starts 4 workers itself, giving each
    RANK and WORLD_SIZE (as torch's env:// allows): a larger world than the launcher's is the
    program's own, not a left-over."""
    from distcomm import TCPStore

    with TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) as master:  # (worker 0's)
        env = {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1",
               "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master.port), "WORLD_SIZE": "4", "RANK": "2"}
        fake_env(env)
        store, rank, size = next(rendezvous("env://", timeout=10))
        store.close()
    assert (rank, size) == (2, 4)


@pytest.mark.parametrize("junk", [{"SLURM_STEP_NODELIST": "node[01-"}, {"OMPI_COMM_WORLD_SIZE": "four"}],
                         ids=["slurm-nodelist", "ompi-size"])
def test_a_malformed_launcher_variable_is_not_needed_when_the_four_are_set(fake_env, junk):
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT all set: a left-over launcher variable
    that does not parse is not read (it would say nothing they do not)."""
    from distcomm import TCPStore

    base = {**SLURM} if "SLURM_STEP_NODELIST" in junk else {**OMPI}
    with TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) as master:
        fake_env({**base, **junk, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(master.port)})
        store, rank, size = next(rendezvous("env://", timeout=10))
        store.close()
    assert (rank, size) == (1, 2)


def test_the_url_overrides_the_launcher_on_purpose(fake_env):
    port = free_port()
    fake_env({**SLURM, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "1"})
    store, rank, size = next(rendezvous("env://?rank=0&world_size=1", timeout=10))
    store.close()
    assert (rank, size) == (0, 1)


def test_nothing_found_is_one_line_naming_the_missing_variables(fake_env):
    fake_env({"MASTER_ADDR": "127.0.0.1"})
    with pytest.raises(DistRendezvousError) as info:
        next(rendezvous("env://"))
    text = str(info.value)
    assert "\n" not in text and info.value.variable == "WORLD_SIZE"
    assert "not set: WORLD_SIZE, RANK, MASTER_PORT; no launcher found" in text


def test_mpirun_across_hosts_without_master_addr_says_what_to_do(fake_env):
    fake_env({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    with pytest.raises(DistRendezvousError, match="Open MPI does not say it: .*-x MASTER_ADDR") as i:
        next(rendezvous("env://"))
    assert i.value.variable == "MASTER_ADDR"


def test_launch_info_is_frozen():
    with pytest.raises(AttributeError):
        LaunchInfo("x").rank = 1  # type: ignore[misc]


# -- real launchers -------------------------------------------------------------------------

PROG = """
import os
import numpy as np
import distcomm as dist
dist.init_process_group("tcp")
a = np.ones(1)
dist.all_reduce(a)
line = f"rank {dist.get_rank()} of {dist.get_world_size()} sum {a[0]} local {os.environ.get('LOCAL_RANK')}"
os.write(1, (line + "\\n").encode())  # one write: the ranks share the launcher's stdout
dist.destroy_process_group()
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES)}


def _mpirun() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


@pytest.mark.skipif(_mpirun() is None, reason="no mpirun next to this Python or on PATH")
def test_real_mpirun(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROG))
    env = {**_clean_env(), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run([_mpirun(), "--oversubscribe", "-n", "2", sys.executable, str(prog)],
                         capture_output=True, text=True, timeout=50, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(out.stdout.splitlines()) == [f"rank {r} of 2 sum 2.0 local {r}" for r in (0, 1)]


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="torch is not installed"
)
def test_real_torchrun(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROG))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(prog)], capture_output=True, text=True, timeout=55, cwd=tmp_path,
        env=dict(_clean_env(), TMPDIR=str(tmp_path)))  # torchrun leaves its log directory in TMPDIR
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(out.stdout.splitlines()) == [f"rank {r} of 2 sum 2.0 local {r}" for r in (0, 1)]
