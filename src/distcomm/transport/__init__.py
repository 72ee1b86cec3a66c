"""Transports: the Channel contract and its implementations (tcp, in-process)."""
