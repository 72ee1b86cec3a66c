"""Benchmarks behind ``distcomm bench NAME`` (see :mod:`distcomm.bench.cli`).

* ``store`` (:mod:`distcomm.bench.store`): TCPStore latency, throughput and
  rendezvous time, optionally side by side with ``torch.distributed.TCPStore``.
"""
