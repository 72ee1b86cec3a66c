"""The channel groups' staging buffers: small ones are reused; a big one only while big calls repeat."""

from __future__ import annotations

import numpy as np

from distcomm.backends.channel_group import _Staging

F64 = np.dtype(np.float64)
U8 = np.dtype(np.uint8)


def test_small_buffers_are_reused():
    staging = _Staging()
    a = staging.take("gather", F64, 1000)
    assert np.shares_memory(a, staging.take("gather", F64, 500))
    assert not np.shares_memory(a, staging.take("scatter", F64, 500))  # one per name


def test_a_single_big_call_keeps_nothing_big():
    staging = _Staging()
    small = staging.take("gather", F64, 1000)
    big = staging.take("gather", U8, _Staging.KEEP_BYTES + 1)
    assert big.size == _Staging.KEEP_BYTES + 1
    assert all(buf.size <= _Staging.KEEP_BYTES for buf in staging._bufs.values())
    assert np.shares_memory(staging.take("gather", F64, 1000), small)  # the small one stays


def test_repeated_big_calls_reuse_their_buffer_until_a_small_call():
    staging = _Staging()
    size = _Staging.KEEP_BYTES + 1
    staging.take("gather", U8, size)
    second = staging.take("gather", U8, size)
    assert np.shares_memory(staging.take("gather", U8, size), second)
    staging.take("gather", F64, 10)
    assert all(buf.size <= _Staging.KEEP_BYTES for buf in staging._bufs.values())
