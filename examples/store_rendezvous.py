"""Start N processes that find each other through a distcomm TCPStore.

Each process rendezvouses with ``tcp://`` (rank 0 hosts the store), publishes
where it runs, counts itself in, waits for everyone, and rank 0 prints who
came.  Run: ``python examples/store_rendezvous.py --world-size 4``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import distcomm


def worker(rank: int, world_size: int, url: str) -> None:
    store, rank, world_size = next(distcomm.rendezvous(url, rank=rank, world_size=world_size))
    with store:
        store.set(f"where/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        arrived = store.add("arrived", 1)
        store.wait([f"where/{r}" for r in range(world_size)])
        if rank == 0:
            print(f"{world_size} rank{'s' if world_size != 1 else ''} met through {url} (rank 0 arrived as number {arrived}):")
            for r, where in enumerate(store.multi_get([f"where/{r}" for r in range(world_size)])):
                print(f"  rank {r}: {where.decode()}")
        store.set(f"done/{rank}", "1")
        if rank == 0:  # the store's host leaves last
            store.wait([f"done/{r}" for r in range(world_size)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args()
    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: expected a number of processes >= 1")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: expected a TCP port, 0 to 65535 (0: a free one)")
    port = args.port
    if port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    t0 = time.perf_counter()
    procs = [
        mp.Process(target=worker, args=(r, args.world_size, url)) for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"ranks {failed} failed")
    print(f"done in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
