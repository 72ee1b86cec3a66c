"""The flight recorder's default dump directory, ``/tmp/distcomm-flight-<run id>``: a name
other local users can guess (the run id shows in ``ps``), so the dump must never be written
into a directory someone else made first, nor through a link planted in it."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest

from distcomm.debug import flight_recorder

NOBODY = 65534


@pytest.fixture
def default_dir(monkeypatch):
    """Dumps go to the default directory (no DISTCOMM_FLIGHT_RECORDER_DIR, no launcher's run
    id), for a run id of this test's: yields the directory's name; removes what was made."""
    for name in (flight_recorder.ENV_DIR, "DISTCOMM_RUN_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    saved = dict(flight_recorder._state)
    run_id = f"test-{uuid.uuid4().hex}"
    flight_recorder.set_world(0, 1, run_id)
    path = os.path.join("/tmp", f"distcomm-flight-{run_id}")
    assert flight_recorder.dump_dir() == path
    try:
        yield path
    finally:
        flight_recorder._state.update(saved)
        shutil.rmtree(path, ignore_errors=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user (chown)")


@needs_root
@pytest.mark.timeout(30)
@pytest.mark.parametrize("shrinks", [0, 1], ids=["top", "after-shrink"])
def test_default_dir_made_by_another_user_is_refused(default_dir, shrinks):
    """The default directory (or, after shrink_group, the one its ``shrink<k>`` goes in)
    already there and another user's: the dump is refused, and nothing is written in it."""
    os.mkdir(default_dir, 0o777)
    os.chmod(default_dir, 0o777)  # (what an attacker would leave: anyone may write in it)
    os.chown(default_dir, NOBODY, NOBODY)
    if shrinks:
        flight_recorder.move(0, 1, shrinks)
        assert flight_recorder.dump_dir() == os.path.join(default_dir, "shrink1")
    with pytest.raises(OSError, match="not a directory of this user's"):
        flight_recorder.dump_flight_recorder()
    assert os.listdir(default_dir) == []


@pytest.mark.timeout(30)
def test_dump_never_follows_a_link_at_its_temporary_name(default_dir, tmp_path):
    """A symbolic link at the name the dump writes first (``rank0.json.<pid>.tmp``) pointing
    at a file: that file is left as it was, and the dump is a file of its own."""
    precious = tmp_path / "precious.txt"
    precious.write_text("precious data\n")
    os.mkdir(default_dir, 0o700)
    target = os.path.join(default_dir, "rank0.json")
    os.symlink(precious, f"{target}.{os.getpid()}.tmp")
    assert flight_recorder.dump_flight_recorder() == target
    assert precious.read_text() == "precious data\n"
    assert not os.path.islink(target)
    with open(target) as f:
        assert json.load(f)["rank"] == 0
    assert os.listdir(default_dir) == ["rank0.json"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shrinks", [0, 1], ids=["top", "after-shrink"])
def test_default_dir_is_made_private(default_dir, shrinks):
    """The default directory the dump makes (and, after shrink_group, its ``shrink<k>``) is
    the user's alone: mode 0700, whatever the umask lets through."""
    if shrinks:
        flight_recorder.move(0, 1, shrinks)
    old = os.umask(0o022)
    try:
        path = flight_recorder.dump_flight_recorder()
    finally:
        os.umask(old)
    made = [default_dir, os.path.join(default_dir, "shrink1")] if shrinks else [default_dir]
    assert os.path.dirname(path) == made[-1]
    for d in made:
        st = os.lstat(d)
        assert st.st_uid == os.geteuid()
        assert oct(st.st_mode & 0o777) == oct(0o700), d
    with open(path) as f:
        assert json.load(f)["reason"] == "dump_flight_recorder() called"
