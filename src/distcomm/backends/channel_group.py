"""``ChannelProcessGroup``: every collective, over any :class:`Channel`.

Each method checks its arguments (one-line errors, nothing issued on bad
input), then issues the collective on the group's serial executor, running
an algorithm of :mod:`distcomm.algorithms` over the channel.  Lists of
tensors are packed into one staging buffer the group keeps and reuses (so
memory stays flat over repeated calls); single tensors are used in place.
Point-to-point calls post straight to the channel, off the executor.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import algorithms as algo
from ..algorithms.select import choose
from ..arrays import ArrayRef, as_array, data_address, native_dtype_name
from ..deadline import Deadline
from ..debug import recorder as _rec
from ..errors import DistBackendError, DistInputError, DistTimeoutError, DistTypeError
from ..group import ProcessGroup, describe_rank
from ..memcopy import copy_into
from ..reduce_op import FINALIZED, finalize, mark_of, op_combiner
from ..transport.base import COLLECTIVE_CODES, Channel, Request, check_p2p_tag, coded_seq
from ..work import DistFuture, Work, wait_seconds

log = logging.getLogger("distcomm.group")

__all__ = ["ChannelProcessGroup"]

#: Each collective's code, carried in its messages' tags (a rank whose peer made another call
#: at the same point finds out from the peer's first message).
_ALLREDUCE, _BROADCAST, _REDUCE, _ALLGATHER, _GATHER, _SCATTER, _REDUCE_SCATTER, _ALLTOALL, _BARRIER = (
    COLLECTIVE_CODES[name] for name in ("all_reduce", "broadcast", "reduce", "all_gather", "gather",
                                        "scatter", "reduce_scatter", "all_to_all", "barrier"))
#: The argument description of a collective without arguments (barrier).
_NO_ARGS = (None, None, None, None, None)


class _Staging:
    """Byte buffers reused across collectives (one collective runs at a time).

    A buffer above :data:`KEEP_BYTES` is kept only while calls keep needing one that big
    (the second such call in a row keeps it; a smaller call frees it): one gather of big
    objects does not hold ``group size x message`` bytes for the rest of the group's life,
    and a loop of big collectives still reuses its buffer.
    """

    #: The largest buffer always kept between calls.
    KEEP_BYTES = 64 << 20

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}
        self._big: set[str] = set()  # names whose last call needed more than KEEP_BYTES

    def take(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        buf = self._bufs.get(name)
        big = nbytes > self.KEEP_BYTES
        if buf is not None and buf.size > self.KEEP_BYTES and not big:
            buf = None  # the big calls are over: free their buffer
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 64), np.uint8)
            if not big or name in self._big:
                self._bufs[name] = buf
        if big:
            self._big.add(name)
        else:
            self._big.discard(name)
        return buf[:nbytes].view(dtype)


class ChannelAlgorithms:
    """The algorithms of :mod:`distcomm.algorithms` bound to one channel.

    A backend with collectives of its own (shared memory) gives the group
    another object with these methods; point-to-point stays on the channel.
    """

    #: ``reduce`` leaves non-root inputs untouched (no staging copy needed).
    reduce_keeps_input = False

    def __init__(self, channel: Channel, staging: _Staging) -> None:
        self.channel = channel
        self._staging = staging
        self._scratch = algo.Scratch()  # one collective runs at a time

    def start_call(self, seq: int, code: int, root: int | None = None, mark: int = 0,
                   variant: int = 0) -> int:
        """``seq`` coded for collective ``code`` (its root or reduction, and the algorithm
        chosen); the channel is told the call starts (it raises if a message of an earlier
        call was never taken: see :meth:`~distcomm.transport.base.Channel.begin_call`)."""
        coded = coded_seq(seq, code, root, mark, variant)
        self.channel.begin_call(coded)
        return coded

    def barrier(self, seq: int, deadline: Deadline) -> None:
        algo.barrier(self.channel, self.start_call(seq, _BARRIER), deadline)

    def broadcast(self, arr: np.ndarray, root: int, seq: int, deadline: Deadline,
                  user_root: int | None = None) -> None:
        """``user_root``: the root the messages' tags name, when not ``root`` (the leaders of a
        hierarchical group broadcast from the root's machine, tagged with the caller's root)."""
        name, variant = choose("broadcast", arr.nbytes, self.channel.size)
        coded = self.start_call(seq, _BROADCAST, root if user_root is None else user_root, variant=variant)
        algo.broadcast(self.channel, arr, root, coded, deadline, algo=name)

    def allreduce(self, arr: np.ndarray, combine: Any, seq: int, deadline: Deadline,
                  code: int = _ALLREDUCE, root: int | None = None) -> None:
        """``code``, ``root``: the call the messages' tags name (a hierarchical ``reduce``
        runs an all-reduce among the machines' leaders, tagged as the reduce it is)."""
        name, variant = choose("allreduce", arr.nbytes, self.channel.size)
        seq = self.start_call(seq, code, root, mark=mark_of(combine), variant=variant)
        algo.allreduce(self.channel, arr, combine, seq, deadline, algo=name, scratch=self._scratch)

    def reduce(self, arr: np.ndarray, combine: Any, root: int, seq: int, deadline: Deadline) -> None:
        name, variant = choose("reduce", arr.nbytes, self.channel.size)
        seq = self.start_call(seq, _REDUCE, root, mark_of(combine), variant)
        algo.reduce(self.channel, arr, combine, root, seq, deadline, algo=name, scratch=self._scratch)

    def allgather(self, out: np.ndarray, seq: int, deadline: Deadline) -> None:
        name, variant = choose("allgather", out.nbytes, self.channel.size)
        algo.allgather(self.channel, out, self.start_call(seq, _ALLGATHER, variant=variant), deadline, algo=name,
                       scratch=self._scratch)

    def gather(self, send: np.ndarray, out: np.ndarray | None, root: int, seq: int,
               deadline: Deadline) -> None:
        algo.gather(self.channel, send, out, root, self.start_call(seq, _GATHER, root), deadline)

    def scatter(self, buf: np.ndarray | None, out: np.ndarray, root: int, seq: int,
                deadline: Deadline) -> None:
        algo.scatter(self.channel, buf, out, root, self.start_call(seq, _SCATTER, root), deadline)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, combine: Any, seq: int,
                       deadline: Deadline) -> None:
        """``out`` = this rank's block of the reduction; ``inp`` stays intact
        unless it is the group's own reduce_scatter staging buffer."""
        name, variant = choose("reduce_scatter", inp.nbytes, self.channel.size)
        seq = self.start_call(seq, _REDUCE_SCATTER, mark=mark_of(combine), variant=variant)
        if name == "direct":
            # reads inp as it is: no staging copy
            algo.direct_reduce_scatter(self.channel, inp, out, combine, seq, deadline, scratch=self._scratch)
            return
        buf = self._staging.take("reduce_scatter", inp.dtype, inp.size)
        if not _same(buf, inp):
            copy_into(buf, inp)  # the algorithm works in place
        out[:] = algo.reduce_scatter(self.channel, buf, combine, seq, deadline, algo=name, scratch=self._scratch)

    def alltoall(self, send: np.ndarray, recv: np.ndarray, seq: int, deadline: Deadline, *,
                 send_counts: Sequence[int], recv_counts: Sequence[int]) -> None:
        algo.alltoall(self.channel, send, recv, self.start_call(seq, _ALLTOALL), deadline,
                      send_counts=send_counts, recv_counts=recv_counts)


class ChannelProcessGroup(ProcessGroup):
    """A process group whose collectives run as algorithms over a channel
    (or over ``algorithms``, an object with :class:`ChannelAlgorithms`' methods)."""

    def __init__(self, channel: Channel, group_name: str, timeout: float, ranks: list[int],
                 algorithms: Any = None) -> None:
        super().__init__(channel.rank, channel.size, group_name, timeout, ranks)
        self.channel = channel
        self._staging = _Staging()
        self.algorithms = algorithms or ChannelAlgorithms(channel, self._staging)
        self._futures = _FutureDriver(group_name)
        #: Sends under way that nobody waited for yet: (request, group rank, bytes); see
        #: _warn_undelivered (a wait forgets its send: _sent).
        self._sends: deque[tuple[Request, int, int]] = deque()

    # -- lifecycle hooks ----------------------------------------------------------------
    def _cancel_pending(self, cause: BaseException) -> None:
        self._warn_undelivered()
        self.channel.cancel(cause)

    def _warn_undelivered(self) -> None:
        """Warn of this group's sends that nobody waited for and that did not arrive (at
        destroy: they are lost, and nothing else would say so on this side)."""
        lost = [(peer, n) for req, peer, n in self._sends if not req.done() or req.error is not None]
        self._sends.clear()
        if lost and self._broken is None:
            peers = sorted({self.ranks[p] for p, _ in lost})
            many = len(lost) > 1
            log.warning(
                "group %r destroyed with %d undelivered send%s that nobody waited for (to rank%s %s, "
                "%d bytes): %s lost; wait for an isend's Work (or use send) before destroying the "
                "group", self.group_name, len(lost), "s" if many else "", "s" if len(peers) > 1 else "",
                ", ".join(map(str, peers)), sum(n for _, n in lost), "they are" if many else "it is")

    def _abort_transport(self, cause: BaseException) -> None:
        self.channel.abort(cause)

    def shutdown(self) -> None:
        super().shutdown()
        # the collectives may hold views of shared memory (a hierarchical group's machine part
        # too): a destroyed group that is still referenced must not keep its segments mapped
        self.algorithms = None

    def _stop_helpers(self, cause: BaseException) -> None:
        self._futures.stop(cause)

    def _release(self) -> None:
        self.channel.close()

    # -- helpers ---------------------------------------------------------------------------
    def _ref(self, obj: Any, what: str, writable: bool = True) -> ArrayRef:
        return as_array(obj, writable=writable, what=what)

    def _refs(self, objs: Any, what: str, writable: bool = True, n: int | None = None,
              back: list[tuple[Any, Any]] | None = None) -> list[ArrayRef]:
        """The arrays of a list of tensors.  Strided entries (as torch allows in lists) are
        staged in contiguous copies: an input's is taken now, an output's goes to ``back``
        (pairs of the entry and its copy) for :func:`_write_back` once the result is in."""
        if not isinstance(objs, (list, tuple)):
            raise DistTypeError(f"{what} must be a list of tensors, got {type(objs).__name__}")
        if n is not None and len(objs) != n:
            raise DistInputError(
                f"{what} has {len(objs)} tensors; expected one per rank of the group ({n})"
            )
        refs = []
        for i, o in enumerate(objs):
            copy = _contiguous_copy(o, writable)
            if copy is not None and writable:
                assert back is not None, "an output list needs somewhere to write strided entries back"
                back.append((o, copy))
            refs.append(self._ref(o if copy is None else copy, f"{what}[{i}]", writable))
        return refs

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self._size:
            raise DistInputError(f"{what} {root} is not a rank of this group [0, {self._size})")

    def _check_dtype(self, ref: ArrayRef, like: ArrayRef) -> None:
        if ref.dtype != like.dtype:
            raise DistInputError(
                f"{ref.what} has dtype {ref.dtype} but {like.what} has {like.dtype}; they must match"
            )

    def _check_like(self, ref: ArrayRef, like: ArrayRef, factor: int = 1) -> None:
        self._check_dtype(ref, like)
        if ref.numel != like.numel * factor:
            times = f"{factor} x " if factor != 1 else ""
            raise DistInputError(
                f"{ref.what} has {ref.numel} elements; expected {times}{like.numel} "
                f"(the {like.what} size{' times the group size' if factor != 1 else ''})"
            )

    # -- collectives ----------------------------------------------------------------------
    def broadcast(self, tensor: Any, root: int, async_op: bool = False) -> Work:
        self._check_root(root, "src")
        ref = self._ref(tensor, "tensor", writable=self._rank != root)  # the root's is only read

        def run(seq: int, deadline: Deadline) -> None:
            self.algorithms.broadcast(ref.array, root, seq, deadline)

        return self._submit("broadcast", run, async_op, tensor, (ref.shape, ref.dtype, root, None, None))

    def allreduce(self, tensor: Any, op: Any, async_op: bool = False) -> Work:
        if not async_op and type(tensor) is np.ndarray:
            # the lean lane of the most common small call: a plain contiguous writable NumPy
            # array of a native dtype, an op with nothing to finalize, the group idle (what
            # as_array and _submit check, without the objects they make: about half of the
            # call here); anything else, bad input included, takes the ordinary path
            name = native_dtype_name(tensor.dtype)
            flags = tensor.flags
            if name is not None and flags.c_contiguous and flags.writeable:
                checked, combine = op_combiner(op, name)  # a bad op raises here, as below
                flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
                info = (tensor.shape, name, None, checked, None)
                # (then straight into _run_claimed, which releases the claim; the algorithms
                # are read before the claim: None only once the group is closed, which the
                # claim refuses, so nothing between claim and release can fail)
                algorithms = self.algorithms
                if checked.name not in FINALIZED and self._claim_plain():
                    return self._run_claimed(
                        "all_reduce", next(self._seqs), info, algorithms.allreduce,
                        self.timeout, tensor, (flat, combine),
                    )
        ref = self._ref(tensor, "tensor")
        op, combine = op_combiner(op, ref.dtype)
        final = op.name in FINALIZED

        def run(seq: int, deadline: Deadline) -> None:
            self.algorithms.allreduce(ref.array, combine, seq, deadline)
            if final:
                finalize(op, ref.array, self._size, ref.dtype)

        return self._submit("all_reduce", run, async_op, tensor, (ref.shape, ref.dtype, None, op, None))

    def reduce(self, tensor: Any, root: int, op: Any, async_op: bool = False) -> Work:
        self._check_root(root, "dst")
        ref = self._ref(tensor, "tensor", writable=self._rank == root)
        op, combine = op_combiner(op, ref.dtype)

        def run(seq: int, deadline: Deadline) -> None:
            arr = ref.array
            if self._rank != root and not self.algorithms.reduce_keeps_input:
                # the algorithm accumulates in place: keep the caller's input intact
                arr = self._staging.take("reduce", ref.array.dtype, ref.numel)
                copy_into(arr, ref.array)
            self.algorithms.reduce(arr, combine, root, seq, deadline)
            if self._rank == root:
                finalize(op, arr, self._size, ref.dtype)

        return self._submit("reduce", run, async_op, tensor, (ref.shape, ref.dtype, root, op, None))

    def allgather(self, output_list: Any, tensor: Any, async_op: bool = False) -> Work:
        inp = self._ref(tensor, "tensor", writable=False)
        back: list[tuple[Any, Any]] = []
        outs = self._refs(output_list, "tensor_list", n=self._size, back=back)
        if any(o.numel != inp.numel for o in outs):
            return self._allgather_uneven(output_list, outs, inp, async_op, back)
        for o in outs:
            self._check_like(o, inp)
        n = inp.numel

        def run(seq: int, deadline: Deadline) -> None:
            buf = self._staging.take("gather", inp.array.dtype, n * self._size)
            buf[self._rank * n : (self._rank + 1) * n] = inp.array
            self.algorithms.allgather(buf, seq, deadline)
            for i, o in enumerate(outs):
                copy_into(o.array, buf[i * n : (i + 1) * n])
            _write_back(back)

        return self._submit("all_gather", run, async_op, output_list, (inp.shape, inp.dtype, None, None, None))

    def _allgather_uneven(self, output_list: Any, outs: list[ArrayRef], inp: ArrayRef, async_op: bool,
                          back: list[tuple[Any, Any]]) -> Work:
        """``all_gather`` of blocks of different sizes (as torch allows): rank i's block is
        ``tensor_list[i]``'s size, which every rank must give alike (DETAIL checks it; else
        the transfer of a block of another size fails, naming both); sent as an all-to-all."""
        for o in outs:
            self._check_dtype(o, inp)
        mine = outs[self._rank]
        if mine.numel != inp.numel:
            raise DistInputError(
                f"{mine.what} (this rank's block) has {mine.numel} elements but tensor has {inp.numel}; "
                f"they must match"
            )
        counts = [o.numel for o in outs]
        sends = [inp.numel] * self._size
        dtype = inp.array.dtype

        def run(seq: int, deadline: Deadline) -> None:
            send = self._staging.take("a2a_send", dtype, inp.numel * self._size)
            recv = self._staging.take("a2a_recv", dtype, sum(counts))
            send.reshape(self._size, inp.numel)[:] = inp.array.reshape(1, -1)
            self.algorithms.alltoall(send, recv, seq, deadline, send_counts=sends, recv_counts=counts)
            _unpack(recv, [o.array for o in outs])
            _write_back(back)

        return self._submit("all_gather", run, async_op, output_list,
                            (None, inp.dtype, None, None, (sends, counts)))

    def allgather_into_tensor(self, output: Any, input: Any, async_op: bool = False) -> Work:
        inp = self._ref(input, "input_tensor", writable=False)
        out = self._ref(output, "output_tensor")
        self._check_like(out, inp, self._size)
        n = inp.numel

        def run(seq: int, deadline: Deadline) -> None:
            mine = out.array[self._rank * n : (self._rank + 1) * n]
            if not _same(mine, inp.array):
                copy_into(mine, inp.array)
            self.algorithms.allgather(out.array, seq, deadline)

        return self._submit("all_gather_into_tensor", run, async_op, output,
                            (inp.shape, inp.dtype, None, None, None))

    def gather(self, tensor: Any, gather_list: Any, root: int, async_op: bool = False) -> Work:
        self._check_root(root, "dst")
        inp = self._ref(tensor, "tensor", writable=False)
        outs: list[ArrayRef] = []
        back: list[tuple[Any, Any]] = []
        if self._rank == root:
            if gather_list is None:
                raise DistInputError("gather_list is required on the destination rank")
            outs = self._refs(gather_list, "gather_list", n=self._size, back=back)
            for o in outs:
                self._check_like(o, inp)
        elif gather_list:
            raise DistInputError("gather_list must be None (or empty) on ranks other than dst")
        n = inp.numel

        def run(seq: int, deadline: Deadline) -> None:
            buf = None
            if self._rank == root:
                buf = self._staging.take("gather", inp.array.dtype, n * self._size)
            self.algorithms.gather(inp.array, buf, root, seq, deadline)
            for i, o in enumerate(outs):
                copy_into(o.array, buf[i * n : (i + 1) * n])
            _write_back(back)

        return self._submit("gather", run, async_op, gather_list, (inp.shape, inp.dtype, root, None, None))

    def scatter(self, tensor: Any, scatter_list: Any, root: int, async_op: bool = False) -> Work:
        self._check_root(root, "src")
        out = self._ref(tensor, "tensor")
        ins: list[ArrayRef] = []
        if self._rank == root:
            if scatter_list is None:
                raise DistInputError("scatter_list is required on the source rank")
            ins = self._refs(scatter_list, "scatter_list", writable=False, n=self._size)
            for i in ins:
                self._check_like(i, out)
        elif scatter_list:
            raise DistInputError("scatter_list must be None (or empty) on ranks other than src")
        n = out.numel

        def run(seq: int, deadline: Deadline) -> None:
            buf = None
            if self._rank == root:
                buf = self._staging.take("scatter", out.array.dtype, n * self._size)
                for i, r in enumerate(ins):
                    buf[i * n : (i + 1) * n] = r.array
            self.algorithms.scatter(buf, out.array, root, seq, deadline)

        return self._submit("scatter", run, async_op, tensor, (out.shape, out.dtype, root, None, None))

    def reduce_scatter(self, output: Any, input_list: Any, op: Any, async_op: bool = False) -> Work:
        out = self._ref(output, "output")
        ins = self._refs(input_list, "input_list", writable=False, n=self._size)
        for i in ins:
            self._check_like(i, out)
        op, combine = op_combiner(op, out.dtype)
        n = out.numel

        def run(seq: int, deadline: Deadline) -> None:
            buf = self._staging.take("reduce_scatter", out.array.dtype, n * self._size)
            for i, r in enumerate(ins):
                buf[i * n : (i + 1) * n] = r.array
            self.algorithms.reduce_scatter(out.array, buf, combine, seq, deadline)
            finalize(op, out.array, self._size, out.dtype)

        return self._submit("reduce_scatter", run, async_op, output, (out.shape, out.dtype, None, op, None))

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any, async_op: bool = False) -> Work:
        out = self._ref(output, "output")
        inp = self._ref(input, "input", writable=False)
        self._check_like(inp, out, self._size)
        op, combine = op_combiner(op, out.dtype)

        def run(seq: int, deadline: Deadline) -> None:
            self.algorithms.reduce_scatter(out.array, inp.array, combine, seq, deadline)
            finalize(op, out.array, self._size, out.dtype)

        return self._submit("reduce_scatter_tensor", run, async_op, output,
                            (out.shape, out.dtype, None, op, None))

    def alltoall(self, output_list: Any, input_list: Any, async_op: bool = False) -> Work:
        back: list[tuple[Any, Any]] = []
        outs = self._refs(output_list, "output_tensor_list", n=self._size, back=back)
        ins = self._refs(input_list, "input_tensor_list", writable=False, n=self._size)
        dtypes = {r.dtype for r in [*outs, *ins]}
        if len(dtypes) > 1:
            raise DistInputError(f"all_to_all tensors must share one dtype, got {sorted(dtypes)}")
        dtype = (outs or ins)[0].array.dtype
        send_counts = [r.numel for r in ins]
        recv_counts = [r.numel for r in outs]
        _check_own_block(send_counts, recv_counts, self._rank, "all_to_all")

        def run(seq: int, deadline: Deadline) -> None:
            send = self._staging.take("a2a_send", dtype, sum(send_counts))
            recv = self._staging.take("a2a_recv", dtype, sum(recv_counts))
            _pack(send, [r.array for r in ins])
            self.algorithms.alltoall(send, recv, seq, deadline,
                                     send_counts=send_counts, recv_counts=recv_counts)
            _unpack(recv, [r.array for r in outs])
            _write_back(back)

        return self._submit("all_to_all", run, async_op, output_list,
                            (None, outs[0].dtype if outs else ins[0].dtype, None, None,
                             (send_counts, recv_counts)))

    def alltoall_single(
        self, output: Any, input: Any, output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None, async_op: bool = False,
    ) -> Work:
        if (not async_op and output_split_sizes is None and input_split_sizes is None
                and type(output) is np.ndarray and type(input) is np.ndarray):
            # the lean lane of an even split (as all_reduce's): plain C-contiguous arrays of one
            # shape and native dtype, rows divisible by the group size, apart in memory, the
            # group idle; anything else, bad input included, takes the ordinary path
            shape = output.shape
            name = native_dtype_name(output.dtype)
            if (name is not None and input.dtype is output.dtype and input.shape == shape and shape
                    and not shape[0] % self._size and output.flags.c_contiguous and output.flags.writeable
                    and input.flags.c_contiguous and not np.may_share_memory(output, input)
                    and self._claim_plain()):  # (_run_claimed releases the claim)
                counts = [output.size // self._size] * self._size
                return self._run_claimed(
                    "all_to_all_single", next(self._seqs), (shape, name, None, None, (counts, counts)),
                    _alltoall_even, self.timeout, output,
                    (self.algorithms, input.reshape(-1), output.reshape(-1), counts),
                )
        out = self._ref(output, "output")
        inp = self._ref(input, "input", writable=False)
        if out.dtype != inp.dtype:
            raise DistInputError(f"output has dtype {out.dtype} but input has {inp.dtype}; they must match")
        recv_counts = self._splits(out, output_split_sizes, "output_split_sizes")
        send_counts = self._splits(inp, input_split_sizes, "input_split_sizes")
        _check_own_block(send_counts, recv_counts, self._rank, "all_to_all_single")
        if _overlaps(out.array, inp.array):
            raise DistInputError("all_to_all_single output and input must not overlap")

        def run(seq: int, deadline: Deadline) -> None:
            self.algorithms.alltoall(inp.array, out.array, seq, deadline,
                                     send_counts=send_counts, recv_counts=recv_counts)

        return self._submit("all_to_all_single", run, async_op, output,
                            (inp.shape, inp.dtype, None, None, (send_counts, recv_counts)))

    def _splits(self, ref: ArrayRef, splits: Sequence[int] | None, what: str) -> list[int]:
        """Element counts per rank from splits along dimension 0."""
        rows = ref.shape[0] if ref.shape else 1
        per_row = ref.numel // rows if rows else 0
        if splits is None or len(splits) == 0:
            if rows % self._size:
                raise DistInputError(
                    f"{ref.what} has {rows} rows, not divisible by the group size {self._size}; "
                    f"give {what}"
                )
            return [rows // self._size * per_row] * self._size
        splits = list(splits)
        if len(splits) != self._size or any(
            isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in splits
        ):
            raise DistInputError(
                f"{what} must list {self._size} non-negative ints (one per rank), got {splits}"
            )
        if sum(splits) != rows:
            raise DistInputError(
                f"{what} {splits} add up to {sum(splits)} but {ref.what} has {rows} rows"
            )
        return [int(s) * per_row for s in splits]

    def barrier(self, async_op: bool = False, timeout: float | None = None) -> Work:
        """Wait for every rank; ``timeout`` (seconds) overrides the group's for this call."""
        def run(seq: int, deadline: Deadline) -> None:
            self.algorithms.barrier(seq, deadline)

        return self._submit("barrier", run, async_op, info=_NO_ARGS, timeout=timeout)

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        self._check_peer(dst, "dst")
        ref = self._ref(tensor, "tensor", writable=False)
        wire = self._check_tag(tag)
        self.check_usable()
        req = self.channel.isend(dst, wire, ref.bytes())
        work = _RequestWork(self, "send", req, dst, tensor, ref, tag)
        sends = self._sends  # sends under way, to tell at destroy of those nobody waited for
        while sends and sends[0][0].done() and sends[0][0].error is None:
            sends.popleft()
        if not req.done():
            sends.append((req, dst, ref.nbytes))
        return work

    def _sent(self, req: Request) -> None:
        """A send's Work was waited for: forget it (and the array its request holds)."""
        for entry in self._sends:
            if entry[0] is req:
                self._sends.remove(entry)
                return

    def recv(self, tensor: Any, src: int | None, tag: int = 0) -> Work:
        if src is not None:
            self._check_peer(src, "src")
        ref = self._ref(tensor, "tensor")
        wire = self._check_tag(tag)
        self.check_usable()
        req = self.channel.irecv(src, wire, ref.bytes(), shorter=True)  # (as MPI and gloo)
        return _RequestWork(self, "recv", req, src, tensor, ref, tag)

    def _check_peer(self, peer: Any, what: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise DistTypeError(f"{what} must be an int rank, got {type(peer).__name__}")
        self._check_root(peer, what)
        if peer == self._rank:
            me = self.ranks[peer] if self.ranks[peer] == peer else f"{self.ranks[peer]} (group rank {peer})"
            raise DistInputError(f"{what}={me} is this rank; a rank cannot send to or receive from itself")

    @staticmethod
    def _check_tag(tag: Any) -> int:
        return check_p2p_tag(tag)


class _RequestWork(Work):
    """A Work that is a transport request (point-to-point), waited with the group timeout."""

    def __init__(self, pg: ChannelProcessGroup, op: str, req: Request, peer: int | None, result: Any,
                 ref: ArrayRef, tag: int) -> None:
        who = "any rank" if peer is None else describe_rank(pg.ranks, peer)
        super().__init__(op, pg.group_name, None, lambda: who)
        self._pg = pg
        self._req = req
        self._value = result
        self._waiting = threading.Lock()
        self._peer = peer
        self._entry = None
        if _rec.ring is not None:
            self._entry = _rec.entry(pg.group_name, None, op, (ref.shape, ref.dtype, None, None, tag),
                                     _rec.STARTED, peer)
            self._entry.append(weakref.ref(self))  # a dump tells done-but-never-waited from pending

    def wait(self, timeout: Any = None) -> bool:
        if self.op == "send":
            self._pg._sent(self._req)
        if not self._done.is_set():
            limit = wait_seconds(timeout)
            seconds = self._pg.timeout if limit is None else limit
            with self._waiting:
                if not self._done.is_set():
                    self._wait_request(seconds, user_timeout=limit is not None)
        return self._wait_for(0)

    def _wait_request(self, seconds: float, user_timeout: bool) -> None:
        try:
            self._req.wait(Deadline(seconds))
        except DistTimeoutError:
            if user_timeout:  # the caller's own limit: the operation goes on
                raise DistTimeoutError(
                    f"{self.op} on group {self.group!r} did not finish within {seconds:g} s; "
                    f"it waits for {self._peers()}",
                    op=self.op, group=self.group, timeout=seconds,
                ) from None
            hint = (" to receive it (if that rank is itself blocked sending to this one, both wait: "
                    "post one side with isend/irecv first)") if self.op == "send" else ""
            self._fail(DistTimeoutError(f"{self.op} waited {seconds:g} s for {self._peers()}{hint}",
                                        timeout=seconds, peer=self._peer_rank()))
        except BaseException as e:  # noqa: BLE001 - kept and re-raised through Work
            self._fail(e)
        else:
            self._source = getattr(self._req, "source", None)
            if self._entry is not None:
                _rec.finish(self._entry)
            self._finish(self._value)

    def _fail(self, e: BaseException) -> None:
        if self._entry is not None:
            _rec.finish(self._entry, e)
        self._finish(error=self._pg._failed(self.op, None, e))

    def _peer_rank(self) -> int | None:
        return None if self._peer is None else self._pg.ranks[self._peer]

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._req.done():
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - it finished with an error: is_success() and exception() tell
                pass
        return self._done.is_set()

    def _new_future(self) -> DistFuture:
        return _RequestFuture(self)

    def get_future(self) -> DistFuture:
        """A future resolved when the request completes, whoever waits: the group's one
        future thread (:class:`_FutureDriver`) drives it when nobody does."""
        with self._lock:
            fresh = self._future is None
        fut = super().get_future()
        if fresh and not self._done.is_set():
            self._deadline = Deadline(self._pg.timeout)
            if not self._pg._futures.add(self):
                self._finish(error=DistBackendError(f"process group {self.group!r} was destroyed"))
        return fut

    def _drive(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the request (the future thread; the group timeout
        counts from ``get_future``).  False if another thread is waiting for it already."""
        if self._done.is_set():
            return True
        if not self._waiting.acquire(False):
            return False
        try:
            if not self._done.is_set():
                left = self._deadline.remaining()
                if left <= seconds:
                    self._wait_request(left, user_timeout=False)
                else:
                    try:
                        self._wait_request(seconds, user_timeout=True)
                    except DistTimeoutError:
                        pass  # not yet: the driver comes back to it
        finally:
            self._waiting.release()
        return True


class _RequestFuture(DistFuture):
    """The future of a point-to-point Work: ``result()`` (and torch's ``wait()``) wait for
    the request in the caller's thread, as ``Work.wait`` does."""

    def __init__(self, work: _RequestWork) -> None:
        super().__init__()
        self._work = work

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self._work.wait(timeout)
            except BaseException:  # noqa: BLE001 - the future holds the error (or is not done)
                pass
            if self._work._done.is_set():
                timeout = None  # the thread that finished the Work is resolving this future now
            elif timeout is not None:
                timeout = 0
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            try:
                self.result(timeout)
            except BaseException:  # noqa: BLE001 - returned below
                pass
            if timeout is not None:
                timeout = 0
        return super().exception(timeout)


class _FutureDriver:
    """Resolves the futures of a group's point-to-point Works that nobody waits for.

    One thread per group, started on first need: it waits for the oldest pending request
    for a slice of time (returning as soon as it completes) and checks the others between
    slices; slices grow from 1 to 50 ms while nothing completes.  A thread per future
    would cost a thread for each request in flight (and each its own wait loop).
    """

    SLICE_MIN = 0.001
    SLICE_MAX = 0.05

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition(threading.Lock())
        self._pending: list[_RequestWork] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, work: _RequestWork) -> bool:
        """Drive ``work`` until it completes; False once the group was destroyed."""
        with self._cv:
            if self._stopped:
                return False
            self._pending.append(work)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"distcomm-p2p-futures:{self._name}", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        return True

    def _loop(self) -> None:
        slice_s = self.SLICE_MIN
        while True:
            with self._cv:
                self._pending = [w for w in self._pending if not w._done.is_set()]
                while not self._stopped and not self._pending:
                    self._cv.wait()
                if self._stopped:
                    return
                works = list(self._pending)
            waited = works[0]._drive(slice_s)
            progressed = works[0]._done.is_set()
            for w in works[1:]:
                if w._req.done():
                    w._drive(0.0)
                    progressed = True
            if not waited and not progressed:
                with self._cv:  # someone else waits for the oldest: do not spin meanwhile
                    self._cv.wait(slice_s)
            slice_s = self.SLICE_MIN if progressed else min(2 * slice_s, self.SLICE_MAX)

    def stop(self, cause: BaseException) -> None:
        """Stop the thread; Works still pending get their request's error, or ``cause``."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread, pending, self._pending = self._thread, self._pending, []
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
        for w in pending:
            if not w._done.is_set():
                w._finish(error=getattr(w._req, "error", None) or cause)


def _check_own_block(send_counts: list[int], recv_counts: list[int], rank: int, op: str) -> None:
    """The block a rank sends itself must be the size it expects from itself (known here,
    so refused before anything is sent)."""
    if send_counts[rank] != recv_counts[rank]:
        raise DistInputError(
            f"{op}: this rank (group rank {rank}) sends itself {send_counts[rank]} elements but expects "
            f"{recv_counts[rank]}; its input and output splits must agree on its own block"
        )


def _alltoall_even(algorithms: Any, send: np.ndarray, recv: np.ndarray, counts: list[int], seq: int,
                   deadline: Deadline) -> None:
    """``algorithms.alltoall`` with ``counts`` both ways (the even all_to_all_single's lean lane)."""
    algorithms.alltoall(send, recv, seq, deadline, send_counts=counts, recv_counts=counts)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same bytes (the addresses are looked up only when
    their bounds overlap)."""
    return a.nbytes == b.nbytes and np.may_share_memory(a, b) and data_address(a) == data_address(b)


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    return a.nbytes > 0 and b.nbytes > 0 and np.shares_memory(a, b)


def _contiguous_copy(obj: Any, writable: bool) -> Any:
    """A contiguous copy of ``obj`` if it is a strided NumPy array or CPU torch tensor (a list
    entry such as ``out.T`` or ``list(x.chunk(2, dim=1))``), else None (taken as it is)."""
    if isinstance(obj, np.ndarray):
        if obj.flags.c_contiguous or obj.ndim == 0 or (writable and not obj.flags.writeable):
            return None
        return np.ascontiguousarray(obj)
    torch = sys.modules.get("torch")
    if (torch is not None and isinstance(obj, torch.Tensor) and obj.layout == torch.strided
            and obj.device.type == "cpu" and not obj.is_contiguous()):
        return obj.detach().contiguous()
    return None


def _write_back(pairs: list[tuple[Any, Any]]) -> None:
    """Copy each staged output into the strided entry it stands for (see ``_refs``)."""
    for entry, copy in pairs:
        if isinstance(entry, np.ndarray):
            np.copyto(entry, copy)
        else:
            entry.detach().copy_(copy)


def _pack(buf: np.ndarray, arrays: list[np.ndarray]) -> None:
    pos = 0
    for a in arrays:
        buf[pos : pos + a.size] = a
        pos += a.size


def _unpack(buf: np.ndarray, arrays: list[np.ndarray]) -> None:
    pos = 0
    for a in arrays:
        a[:] = buf[pos : pos + a.size]
        pos += a.size
