"""Rendezvous bound to the loopback interface for single-machine jobs.

Notes: docs/internals.md, "lightning_dist/rendezvous.py"."""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment, TorchElasticEnvironment

__all__ = ["attempt_store", "is_loopback", "job_store", "loopback_store"]


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def loopback_store(environment: ClusterEnvironment, *, timeout: timedelta) -> Optional[dist.TCPStore]:
    """A TCPStore listening on the loopback main address only, or None where the default rendezvous applies.

    Rank 0 binds ``(main_address, main_port)`` itself and hands the listening socket to the store
    (``master_listen_fd``); the other ranks connect as clients. Call on every rank before
    ``init_process_group(store=...)``.
    """
    if dist.is_initialized():
        return None  # a later `fit` in the same job reuses the process group (and its store)
    if type(environment) is not LightningEnvironment or not is_loopback(environment.main_address):
        return None
    host = "127.0.0.1" if environment.main_address == "localhost" else environment.main_address
    port, world_size = environment.main_port, environment.world_size()
    if environment.global_rank() != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RuntimeError(
            f"Cannot listen on {host}:{port} for the rendezvous ({err}). Another job uses MASTER_PORT={port}:"
            " pick a free port (or unset MASTER_PORT to let Lightning choose one)."
        ) from err
    sock.listen(max(world_size, 128))
    # detach: the store owns the descriptor from here on (Python must not close it when `sock` is collected)
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())


def attempt_store(environment: ClusterEnvironment, *, timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun's agent store: a client of it with keys prefixed by the restart attempt, else None."""
    if dist.is_initialized() or not isinstance(environment, TorchElasticEnvironment):
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(environment.main_address, environment.main_port, environment.world_size(), False, timeout)
    return dist.PrefixStore(f"lightning_dist/attempt_{attempt}", client)


def job_store(environment: ClusterEnvironment, *, timeout: timedelta) -> Optional[dist.Store]:
    """The store to start the process group from: :func:`loopback_store`, :func:`attempt_store`, or None
    (torch's default ``env://`` rendezvous). Call on every rank."""
    return loopback_store(environment, timeout=timeout) or attempt_store(environment, timeout=timeout)
