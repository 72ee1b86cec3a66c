"""The launcher's node rendezvous (``distcomm.launch.rdzv``) over an in-process store."""

from __future__ import annotations

import pytest

from distcomm.launch import rdzv
from distcomm.store import HashStore


@pytest.mark.timeout(30)
def test_a_node_waiting_for_others_says_so_until_it_gives_up(monkeypatch):
    monkeypatch.setattr(rdzv, "NOTE_AFTER", 0.05)
    monkeypatch.setattr(rdzv, "NOTE_EVERY", 0.2)
    node = rdzv.NodeRendezvous(HashStore(), "job", 2, (3, 3), 0, 0.1, 0.5, "run")
    notes: list[str] = []
    node.say = notes.append
    with pytest.raises(rdzv.RendezvousFailed, match="did not join within 0.5 s"):
        node.join()
    assert 2 <= len(notes) <= 4, notes
    assert notes[0].startswith("waiting for 2 more nodes to join (1 of --nnodes 3 here); giving up in ")
    assert "join_timeout" in notes[0]


@pytest.mark.timeout(30)
def test_a_round_that_closes_at_once_says_nothing(monkeypatch):
    monkeypatch.setattr(rdzv, "NOTE_AFTER", 0.0)
    node = rdzv.NodeRendezvous(HashStore(), "job", 2, (1, 1), 0, 0.1, 5.0, "run")
    notes: list[str] = []
    node.say = notes.append
    members = node.join()
    assert (members.nnodes, members.group_rank, members.world_size) == (1, 0, 2)
    assert notes == []
