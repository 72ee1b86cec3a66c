"""Benchmarks behind ``distcomm bench NAME`` (see :mod:`distcomm.bench.cli`).

* ``store`` (:mod:`distcomm.bench.store`): TCPStore latency, throughput and
  rendezvous time, optionally side by side with ``torch.distributed.TCPStore``.
* ``collectives`` (:mod:`distcomm.bench.collectives`): time per call of each
  collective against size, vs torch gloo and MPI, checked results, targets.
* ``plot`` (:mod:`distcomm.bench.plot`): draw a saved collectives run.
"""
