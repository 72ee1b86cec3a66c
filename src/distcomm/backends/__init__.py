"""Backends: process groups built on a transport (tcp) and the registry entries for them."""
