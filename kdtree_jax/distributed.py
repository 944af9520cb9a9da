"""Several hosts, one mesh: `jax.distributed` behind a thin wrapper, and the checks that keep processes in step.

Every process runs the same program on the same inputs (SPMD): it joins the job with `init_distributed`, builds the
same mesh over the global devices (`kj.make_mesh`, the tensor axis kept inside a host), loads the same checkpoint
(each process restores only the shards its devices hold) and calls the same jitted functions in the same order.
Results are replicated arrays; `to_host` reads them on any process, and only process 0 prints. A process that
starts with another checkpoint, config or mesh is caught by `check_same` with a message, instead of a hang in the
first collective.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import time

import jax
import numpy as np

_STATE = {"initialized": False}


class DistributedError(RuntimeError):
    """Processes of one job that cannot run together (bad arguments, or they disagree on what they run)."""


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, local_device_ids=None, timeout_s: int = 300) -> None:
    """Join a multi-process JAX job (a thin wrapper over `jax.distributed.initialize`).

    Give the coordinator "HOST:PORT" (process 0 listens there), the process count and this process's id; or give
    none of them on a cluster whose environment JAX reads itself (SLURM, Open MPI, Cloud TPU). Call it first,
    before anything touches a device. CPU devices exchange data through gloo. Calling it again does nothing.
    """
    if _STATE["initialized"]:
        return
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise DistributedError("give all of coordinator_address, num_processes and process_id, or none of them "
                               "(the cluster's environment)")
    if coordinator_address is not None:
        if not re.fullmatch(r"[^\s:]+:\d{1,5}", coordinator_address) or not 0 < int(
                coordinator_address.rsplit(":", 1)[1]) < 65536:
            raise DistributedError(f"coordinator address must be HOST:PORT, got {coordinator_address!r}")
        for name, v in (("num_processes", num_processes), ("process_id", process_id)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise DistributedError(f"{name} must be an integer, got {v!r}")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise DistributedError(f"process_id must be in 0..{num_processes - 1} for {num_processes} processes, "
                                   f"got {process_id}")
    where = f" at {coordinator_address} as process {process_id} of {num_processes}" if coordinator_address else ""
    print(f"[kdtree-jax] joining the multi-process job{where}: waiting up to {timeout_s} s for every process",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    if coordinator_address is not None and process_id > 0:
        _wait_for_coordinator(coordinator_address, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids,
                               initialization_timeout=max(1, int(round(timeout_s - (time.monotonic() - start)))))
    _STATE["initialized"] = True


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until something accepts TCP connections at the coordinator's address (process 0 listens there), or raise:
    jax.distributed.initialize waits for it too, but ends the whole process in a fatal abort when it never comes."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(f"no coordinator at {address} after {timeout_s:g} s ({e.strerror or e}): start "
                                       "process 0 there, with the same --coordinator") from None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def is_leader() -> bool:
    """True on process 0 (the one that prints and returns text)."""
    return jax.process_index() == 0


def to_host(x) -> np.ndarray:
    """A jax.Array as numpy on this process: directly when this process holds all of it, from its own copy when
    it is replicated over processes, else gathered from every process."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def fingerprint(value) -> str:
    """A stable digest of a JSON-able value (configs, manifests, mesh shapes)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def check_same(what: str, value) -> None:
    """Raise DistributedError on every process when the processes hold different `value`s (no-op alone)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes.fromhex(fingerprint(value)), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if differ:
        raise DistributedError(f"{what} differs between processes: process(es) {differ} disagree with process 0 "
                               "(every process must run the same checkpoint, config, mesh and inputs)")
