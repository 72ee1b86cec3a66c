"""Which algorithm a collective uses: every threshold in one place.

The choice depends only on the message size in bytes and the world size,
so every rank of a group makes the same one.  ``DISTCOMM_<NAME>_ALGO``
(e.g. ``DISTCOMM_ALLREDUCE_ALGO=ring``) forces an algorithm, for tests and
benchmarks; it must then be set alike on every rank.  Read at each call.

Rationale: small messages want few messages and rounds, large ones halved or
neighbour-only, pipelined traffic.  The values were measured over the TCP
transport with 2 to 8 processes sharing 2 cores, each algorithm forced in
turn, 64 B to 32 MiB (on a busy machine: differences under ~1.5x are noise).  With more ranks than cores the
total number of messages matters more than the number of rounds, which is
why the pipelined tree (2(n-1) messages) beats recursive doubling (n log2 n)
up to mid sizes there; on hosts with a core per rank, ``rd`` is the
lower-latency choice for tiny messages (force it with the variable).
"""

from __future__ import annotations

import os

from ..errors import DistInputError

KiB = 1024
MiB = 1024 * KiB

#: allreduce on 2 ranks: recursive doubling (one exchange) up to this many bytes, ring above.
ALLREDUCE_RD_MAX_BYTES = 32 * KiB
#: allreduce on 3+ ranks: pipelined binomial reduce + broadcast up to this many bytes ...
ALLREDUCE_TREE_MAX_BYTES = 2 * MiB
#: ... then halving-doubling up to this many on a power-of-two world, ring otherwise/above
#: (folding the extra ranks of other worlds costs two more full messages).  4 ranks on 2
#: cores, alternating runs: hd took 0.87-0.94x ring's time at 32 MiB, 0.81-0.89x at 64 MiB,
#: 0.91-0.99x at 128 MiB (8 ranks: 0.92-0.94x at 16 MiB, 0.85-1.02x at 64 MiB).
ALLREDUCE_HD_MAX_BYTES = 128 * MiB
#: broadcast: pipelined chain from this many bytes (3+ ranks), pipelined binomial tree
#: below (the tree won at every measured size up to 16 MiB on 2 cores).
BROADCAST_CHAIN_MIN_BYTES = 64 * MiB
#: reduce: ring reduce-scatter + gather from this many bytes (3+ ranks), binomial below.
REDUCE_RING_MIN_BYTES = 4 * MiB
#: allgather: Bruck (log2 n rounds, two local copies) up to this many output bytes,
#: for worlds of at least ALLGATHER_BRUCK_MIN_WORLD; ring otherwise.
ALLGATHER_BRUCK_MAX_BYTES = 64 * KiB
ALLGATHER_BRUCK_MIN_WORLD = 4
#: reduce_scatter: a recursive-doubling allreduce up to this many input bytes,
#: for worlds of at least REDUCE_SCATTER_RD_MIN_WORLD; above, direct (every rank
#: sends each block straight to its owner: one round) in worlds up to
#: REDUCE_SCATTER_DIRECT_MAX_WORLD, ring in larger ones.
REDUCE_SCATTER_RD_MAX_BYTES = 64 * KiB
REDUCE_SCATTER_RD_MIN_WORLD = 4
REDUCE_SCATTER_DIRECT_MAX_WORLD = 8

#: The algorithms of each collective that has a choice.
ALGORITHMS = {
    "allreduce": ("ring", "hd", "rd", "tree"),
    "broadcast": ("binomial", "chain"),
    "reduce": ("binomial", "ring"),
    "allgather": ("ring", "bruck"),
    "reduce_scatter": ("ring", "rd", "direct"),
}


def env_var(collective: str) -> str:
    return f"DISTCOMM_{collective.upper()}_ALGO"


def check_algorithm(collective: str, name: str) -> str:
    if name not in ALGORITHMS[collective]:
        raise DistInputError(
            f"unknown {collective} algorithm {name!r}; expected one of "
            f"{', '.join(ALGORITHMS[collective])}"
        )
    return name


def _forced(collective: str) -> str | None:
    var = env_var(collective)
    value = os.environ.get(var, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ALGORITHMS[collective]:
        raise DistInputError(
            f"{var}={value!r} is not an algorithm of {collective}; expected one of "
            f"{', '.join(ALGORITHMS[collective])} or auto",
            variable=var,
        )
    return value


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def allreduce_algorithm(nbytes: int, world_size: int) -> str:
    forced = _forced("allreduce")
    if forced:
        return forced
    if world_size <= 2:
        return "rd" if nbytes <= ALLREDUCE_RD_MAX_BYTES else "ring"
    if nbytes <= ALLREDUCE_TREE_MAX_BYTES:
        return "tree"
    return "hd" if nbytes <= ALLREDUCE_HD_MAX_BYTES and _pow2(world_size) else "ring"


def broadcast_algorithm(nbytes: int, world_size: int) -> str:
    forced = _forced("broadcast")
    if forced:
        return forced
    return "chain" if nbytes >= BROADCAST_CHAIN_MIN_BYTES and world_size > 2 else "binomial"


def reduce_algorithm(nbytes: int, world_size: int) -> str:
    forced = _forced("reduce")
    if forced:
        return forced
    return "ring" if nbytes >= REDUCE_RING_MIN_BYTES and world_size > 2 else "binomial"


def allgather_algorithm(total_bytes: int, world_size: int) -> str:
    forced = _forced("allgather")
    if forced:
        return forced
    small = total_bytes <= ALLGATHER_BRUCK_MAX_BYTES
    return "bruck" if small and world_size >= ALLGATHER_BRUCK_MIN_WORLD else "ring"


def reduce_scatter_algorithm(total_bytes: int, world_size: int) -> str:
    forced = _forced("reduce_scatter")
    if forced:
        return forced
    if total_bytes <= REDUCE_SCATTER_RD_MAX_BYTES and world_size >= REDUCE_SCATTER_RD_MIN_WORLD:
        return "rd"
    return "direct" if world_size <= REDUCE_SCATTER_DIRECT_MAX_WORLD else "ring"


_CHOOSERS = {
    "allreduce": allreduce_algorithm,
    "broadcast": broadcast_algorithm,
    "reduce": reduce_algorithm,
    "allgather": allgather_algorithm,
    "reduce_scatter": reduce_scatter_algorithm,
}


def choose(collective: str, nbytes: int, world_size: int) -> tuple[str, int]:
    """The algorithm of ``collective`` for ``nbytes`` (all blocks, for allgather and
    reduce_scatter) on ``world_size`` ranks, and its number (its place in
    :data:`ALGORITHMS`), which the call's messages carry: ranks whose arrays differ in size
    enough to choose differently find out from the first message of the other algorithm."""
    name = _CHOOSERS[collective](nbytes, world_size)
    return name, ALGORITHMS[collective].index(name)
