"""FileStore's file holds every key and value of the job (tokens, addresses): it is made
readable by its owner alone."""

from __future__ import annotations

import os
import stat

import pytest

from distcomm.store.file import FileStore


@pytest.mark.timeout(30)
def test_new_store_file_is_private(tmp_path):
    """A store file FileStore creates has mode 0600 (not 0644), with the usual umask 022;
    a second instance opening it leaves it so."""
    path = tmp_path / "store"
    old = os.umask(0o022)
    try:
        with FileStore(str(path), 2) as first:
            first.set("secret", b"value")
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, oct(os.stat(path).st_mode)
            with FileStore(str(path), 2) as second:
                assert second.get("secret") == b"value"
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        os.umask(old)
