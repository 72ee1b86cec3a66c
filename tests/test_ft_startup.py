"""A restarted replica starts fast: ``import distcomm`` is lazy, the ft path loads only what it needs."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

import distcomm

pytestmark = pytest.mark.timeout(120)

#: Never loaded by a replica: the torch.distributed-style API, the launcher, the lighthouse
#: server (asyncio), the MPI backend, and the optional heavy packages.
NOT_ON_THE_FT_PATH = (
    "distcomm.api", "distcomm.functional", "distcomm.collectives", "distcomm.object_collectives",
    "distcomm.launch.spawn", "distcomm.backends.mpi", "distcomm.ft.lighthouse", "asyncio",
    "torch", "matplotlib", "mpi4py", "hypothesis",
)  # fmt: skip


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_distcomm_loads_nothing_heavy():
    loaded = _loaded_after("import distcomm")
    assert "numpy" not in loaded
    assert sorted(m for m in loaded if m.startswith("distcomm.")) == []


def test_a_replica_loads_only_the_ft_path():
    code = ("from distcomm.ft import Manager\n"
            "from distcomm.backend_registry import resolve_backend\n"
            "resolve_backend('auto', 'auto')")  # what the first quorum's configure loads
    loaded = _loaded_after(code)
    assert "distcomm.ft.manager" in loaded and "distcomm.backends.auto" in loaded
    assert not loaded & set(NOT_ON_THE_FT_PATH), sorted(loaded & set(NOT_ON_THE_FT_PATH))


def test_the_public_api_is_unchanged_when_loaded_lazily():
    code = (
        "import distcomm as dist\n"
        "assert callable(dist.all_reduce) and dist.Backend.available() == "
        "['auto', 'gloo', 'mpi', 'shm', 'tcp']\n"
        "from distcomm import *  # noqa\n"
        "from distcomm import ReduceOp, TCPStore, init_process_group, _make_nccl_premul_sum\n"
        "assert dist.functional.__name__ == 'distcomm.functional' and dist.api.__name__ == 'distcomm.api'\n"
        "assert set(dist.__all__) <= set(dir(dist))\n"
        "try:\n    dist.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "module 'distcomm' has no attribute 'no_such_name'" in out.stdout


def test_the_lazy_map_matches_what_type_checkers_see():
    """Every name imported under TYPE_CHECKING in __init__.py is in _WHERE, from the same module."""
    with open(distcomm.__file__) as f:
        tree = ast.parse(f.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            if node.module is None:  # `from . import functional`: a submodule
                assert alias.name in distcomm._SUBMODULES
            else:
                seen[alias.name] = "." + node.module
    assert seen == distcomm._WHERE
    assert set(distcomm.__all__) - {"__version__"} <= set(seen) | set(distcomm._SUBMODULES)


def test_a_new_backend_registration_still_sees_the_builtin_ones():
    code = ("from distcomm import Backend\n"
            "try:\n    Backend.register_backend('tcp', lambda *a: None)\n"
            "except ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "backend 'tcp' is already registered" in out.stdout
