"""Claims of the newcomer pages that the code can check: signatures, settings, values.

tests/test_docs_examples.py runs the pages' code; these check what the prose
says: a value the docs quote, a choice they list, a setting they name.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import distcomm
from distcomm.algorithms import select
from distcomm.store import tcp_protocol as p

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "distcomm"


def _doc(name: str) -> str:
    return (ROOT / name).read_text()


def _shown(cls: type) -> str:
    """``cls``'s constructor as the README writes it: ``name=default`` with timedeltas spelled out."""
    parts = []
    for param in inspect.signature(cls).parameters.values():
        if param.default is inspect.Parameter.empty:
            parts.append(param.name)
        else:
            default = param.default
            text = f"timedelta(seconds={int(default.total_seconds())})" if hasattr(default, "total_seconds") \
                else repr(default)
            parts.append(f"{param.name}={text}")
    return f"distcomm.{cls.__name__}({', '.join(parts)})"


@pytest.mark.parametrize("cls", [distcomm.TCPStore, distcomm.FileStore, distcomm.HashStore,
                                 distcomm.PrefixStore])
def test_readme_shows_each_store_constructor_whole(cls):
    assert f"`{_shown(cls)}`" in _doc("README.md")


@pytest.mark.parametrize("collective", sorted(select.ALGORITHMS))
def test_backends_page_lists_every_algorithm_a_variable_takes(collective):
    var = select.env_var(collective)
    m = re.search(rf"`{var}` =\s+(.*?);", _doc("docs/backends.md"), re.S)
    assert m, f"docs/backends.md does not name {var}"
    listed = set(re.findall(r"`(\w+)`", m.group(1)))
    assert listed == set(select.ALGORITHMS[collective]), (var, m.group(1))


def test_backends_page_names_every_shm_and_tcp_setting():
    names = set()
    for path in SRC.rglob("*.py"):
        names |= set(re.findall(r'"(DISTCOMM_(?:SHM|TCP)_[A-Z_]+)"', path.read_text()))
    assert "DISTCOMM_SHM_HEAP_BYTES" in names
    page = _doc("docs/backends.md")
    assert not sorted(n for n in names if f"`{n}`" not in page)


def test_migrating_page_quotes_get_backend_config_of_the_default_backend():
    quoted = re.search(r'`get_backend_config\(\)` \(`"cpu:"` and the backend: `"([^"]+)"` by default\)',
                       _doc("docs/migrating.md"))
    assert quoted, "docs/migrating.md no longer quotes get_backend_config()"
    code = ("import distcomm as d; d.init_process_group(store=d.HashStore(), rank=0, world_size=1); "
            "print(d.get_backend_config()); d.destroy_process_group()")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == quoted.group(1)


def test_store_handshake_answers_as_the_protocol_page_says():
    """An unknown version gets UNSUPPORTED with the server's newest version; version 1 ignores flags."""
    page = _doc("docs/store-protocol.md")
    assert "the reply carries the newest version it speaks" in page and "version 1 ignores the\nflags" in page
    with distcomm.TCPStore("127.0.0.1", 0, is_master=True) as server:
        for version, flags, reply in ((p.VERSION + 1, 0, (p.VERSION, p.HS_UNSUPPORTED)),
                                      (1, p.FLAG_AUTH, (1, p.HS_OK))):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(p.HANDSHAKE.pack(p.MAGIC, version, flags))
                got = b""
                while len(got) < p.HANDSHAKE_REPLY.size:
                    chunk = sock.recv(p.HANDSHAKE_REPLY.size - len(got))
                    assert chunk, "the server closed before answering"
                    got += chunk
                assert p.HANDSHAKE_REPLY.unpack(got) == (p.MAGIC, *reply, 0)
