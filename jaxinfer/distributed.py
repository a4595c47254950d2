"""Multi-host serving on JAX's multi-controller runtime: one leader, followers in lockstep.

Every process runs the same program on its own devices of one global mesh. Process 0 (the leader)
runs the scheduler and the gRPC server; before each jitted step it broadcasts that step's inputs
(a small header, then the Batch's integer arrays, or the pages to poison) to the followers with a
collective (`multihost_utils.broadcast_one_to_all`), and every process then calls the same jitted
step on the same global arrays, in the same order. Followers never decide anything: they loop on
`StepChannel.recv`. The leader samples on one of its own devices from its local copy of the
(replicated) logits, so sampling needs no collective.

Failure: a follower that dies breaks the next collective on the leader (gloo reports the closed
connection at once); the engine turns that into `PeerFailureError`, and the server fails the
requests in flight with UNAVAILABLE and reports NOT_SERVING. A process that hangs without dying
blocks the others in their next collective, which never fails: every process therefore marks its
waits on the others (`peer_wait`) and a watchdog bounds them (`--peer-timeout` while serving,
`--peer-startup-timeout` while loading and warming up). An idle leader broadcasts a heartbeat now
and then, so that a follower can tell a hung leader from one with nothing to do, and a leader
notices a hung follower without waiting for traffic.

CPU (tests, and CPU clusters) uses gloo collectives; TPU and GPU use their own. `initialize()`
without arguments lets `jax.distributed.initialize` detect TPU pods and SLURM by itself.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import ipaddress
import json
import math
import os
import socket
import sys
import threading
import time

import jax
import numpy as np

from jaxinfer.errors import InvalidRequestError
from jaxinfer.kv_cache import Batch

_HEADER = 7  # op and its numbers; the last slot: the leader's peer timeout (ms)
OP_STEP, OP_POISON, OP_STOP, OP_HEARTBEAT = 1, 2, 3, 4


class PeerFailureError(RuntimeError):
    """A collective with the other processes failed: a follower died or stopped answering."""


def lost_peers(error: BaseException) -> str | None:
    """The first line of `error` when it is the runtime's word that the other processes are gone (a
    collective whose peer closed its connection or never connected, the coordinator unreachable),
    else None. Seen while loading: gloo's "Connection closed by peer" and "Connect timeout"."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    if isinstance(error, jax.errors.JaxRuntimeError) and any(w in first for w in ("Gloo", "coordination", "onnect")):
        return first
    return None


class _PeerWait:
    """When this process began its present wait on the other processes (a collective in flight,
    from the leader's broadcast to the end of the step it feeds), or None. Watchdogs read it: a
    wait past their limit means a peer hung without dying. Used as a context manager around each
    collective; an inner one inside an outer one keeps the outer start. Only one thread of a process
    runs collectives at a time (the loading thread, then the engine's)."""

    def __init__(self):
        self.since: float | None = None

    @contextlib.contextmanager
    def __call__(self):
        if self.since is not None:
            yield
            return
        self.since = time.monotonic()
        try:
            yield
        finally:
            self.since = None

    def seconds(self) -> float:
        """How long the present wait has lasted (0 when none is in flight)."""
        since = self.since
        return 0.0 if since is None else time.monotonic() - since


peer_wait = _PeerWait()


class Watchdog:
    """A daemon thread that calls `on_timeout(seconds)` once this process has waited on the others
    (`peer_wait`) longer than `limit` seconds. The limit may change as the process goes from
    loading to serving (`phase`, for the message)."""

    def __init__(self, limit: float, on_timeout):
        self.limit = limit
        self.phase = "startup"
        self._on_timeout = on_timeout
        self._thread = threading.Thread(target=self._watch, name="jaxinfer-peer-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            limit = self.limit
            time.sleep(min(0.5, limit / 4))
            waited = peer_wait.seconds()
            if self.limit == limit and waited > limit:
                self._on_timeout(waited)
                return


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: float = 120,
) -> None:
    """Joins the job. With no arguments, JAX detects the cluster (TPU pod slices, SLURM, ...).

    The runtime is put in its recoverable mode: otherwise, once a peer stops sending heartbeats,
    JAX's coordination service aborts every surviving process (a fatal check failure), and their
    exit blocks in a shutdown barrier on the dead peer. jaxinfer handles a broken job itself: the
    leader fails what is in flight with UNAVAILABLE, reports NOT_SERVING and exits 1 on SIGTERM.

    A job that does not form within `initialization_timeout` seconds (process 0 not started or not
    reachable, a process missing) ends this process with status 2 and a line saying which
    (`_JoinGuard`): JAX's own join timeout aborts the process (SIGABRT, a C++ stack trace), and no
    Python code can catch that.
    """
    if (coordinator_address is None) != (num_processes is None) or (num_processes is None) != (process_id is None):
        raise ValueError("give --coordinator-address, --num-processes and --process-id together, or none of them")
    bind = None
    if num_processes is not None:
        if num_processes < 1:
            raise ValueError(f"--num-processes must be at least 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
        host, port = _coordinator(coordinator_address)
        if process_id == 0:
            # A loopback coordinator listens there only (JAX's default is every interface, with no
            # authentication); any other address keeps the default: a cluster name may resolve to
            # an address that is not this machine's own (a Kubernetes service's).
            loopback = is_loopback(host)
            _check_can_listen(host if loopback else "", port, coordinator_address)
            bind = coordinator_address if loopback else None
    jax.config.update("jax_enable_recoverability", True)
    if jax.config.jax_platforms in (None, "", "cpu") or str(jax.config.jax_platforms).startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with _JoinGuard(initialization_timeout, coordinator_address, num_processes, process_id):
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            # Later than the guard's, so that the guard speaks first: JAX's own timeout is an abort.
            initialization_timeout=min(math.ceil(initialization_timeout) + _JAX_JOIN_GRACE, 2**31 - 1),
            coordinator_bind_address=bind,
        )
    if num_processes is not None and jax.process_count() != num_processes:
        # The coordinator's count wins: a follower told 3 joined a job of 2 and served without a word.
        raise ValueError(
            f"--num-processes {num_processes} differs from the job's: the coordinator at {coordinator_address} "
            f"counts {jax.process_count()} processes"
        )


_JAX_JOIN_GRACE = 30  # seconds JAX's join timeout runs past the guard's


class _JoinGuard:
    """Bounds `jax.distributed.initialize`, which blocks in C++ until every process has registered
    and, past its own timeout, aborts the process. A daemon thread ends the process first, with
    status 2 and a line that says what is missing: nothing answering at the coordinator's address
    (process 0 not started, or not reachable from here), or the coordinator up but the job not
    whole (a process not started, or started with another --num-processes)."""

    def __init__(self, timeout: float, address: str | None, num_processes: int | None, process_id: int | None):
        self._timeout, self._address = timeout, address
        self._num_processes, self._process_id = num_processes, process_id
        self._joined = threading.Event()
        # Held from the guard's last look at `_joined` to its exit: a join that completes meanwhile
        # waits for the exit, and one that completed before it stands the guard down.
        self._deciding = threading.Lock()

    def __enter__(self):
        threading.Thread(target=self._watch, name="jaxinfer-join-guard", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        with self._deciding:
            self._joined.set()

    def _watch(self) -> None:
        if self._joined.wait(min(self._timeout, threading.TIMEOUT_MAX)):  # (a huge limit: forever)
            return
        # Looked at again once the message is made: it may try the coordinator for seconds, and a job
        # that formed meanwhile must not lose this process (its peers would abort).
        message = self.message()
        with self._deciding:
            if self._joined.is_set():
                return
            # Straight to the file descriptor and out: the main thread is stuck in C++ code.
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(2)

    def message(self) -> str:
        who = "this process" if self._process_id is None else f"process {self._process_id} of {self._num_processes}"
        waited = f"{who} waited {self._timeout:g} s to join the multi-host job"
        if self._address is None:
            return f"{waited} that JAX detected, and the job did not form"
        whole = (
            f"not all {self._num_processes} processes joined (start each with --coordinator-address "
            f"{self._address} --num-processes {self._num_processes} and its own --process-id)"
        )
        if self._process_id == 0:
            return f"{waited} at {self._address}: {whole}"
        try:
            socket.create_connection(_coordinator(self._address), timeout=5).close()
        except OSError as e:
            return (
                f"{waited} at {self._address}: nothing answers there ({e.strerror or e}): is process 0 "
                "started, and reachable from this machine?"
            )
        return (
            f"{waited} at {self._address}: the coordinator answers, but the job did not form (a process "
            "missing, or process 0 given another --num-processes)"
        )


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name as a flag gives it) is reachable from this machine only:
    localhost or a loopback address. Any other name may resolve to the network."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _coordinator(address) -> tuple[str, int]:
    """HOST and PORT of --coordinator-address, checked: JAX indexes into a malformed one (IndexError),
    wraps a port past 65535, or dies in its gRPC layer."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    # An IPv6 host without its brackets passed as HOST:PORT ("::1" as host ":" and port 1), and gRPC
    # reads "::1:8476" as one address on its default port 443.
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not sep or not host or bare_ipv6 or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--coordinator-address must be HOST:PORT with a port in [1, 65535] (an IPv6 host in brackets: "
            f"[::1]:PORT), got {address!r}"
        )
    return host.strip("[]"), int(port)


def _check_can_listen(host: str, port: int, address: str) -> None:
    """Process 0 runs the coordinator: a port already taken (another job's leader, or a second
    process 0) is refused here by name; JAX's runtime crashed on it now and then, or both waited
    out the join timeout."""
    try:
        family = socket.AF_INET6 if host == "::1" else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # As a listener binds: a port a crashed leader left in TIME_WAIT is free (a restarted job
            # reuses its address), one another process listens on is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"--coordinator-address {address}: process 0 cannot listen there ({e.strerror})") from None


def leader_value(value: int) -> int:
    """The leader's `value` (an int32), on every process."""
    from jax.experimental import multihost_utils

    with peer_wait():
        return int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([value], np.int32)))[0])


def least(value: int) -> int:
    """The smallest of every process's `value` (an int32), on every process."""
    from jax.experimental import multihost_utils

    with peer_wait():
        return int(np.asarray(multihost_utils.process_allgather(np.asarray([value], np.int32))).min())


class JobMismatchError(InvalidRequestError):
    """The processes of one job were started with different models or engine settings."""


def check_same_job(settings: dict) -> None:
    """Every process must run the same model and engine, step for step: a different page count or
    weights would go unnoticed (the collectives only need equal shapes) and give wrong tokens. Each
    process shares a digest per setting; any difference raises JobMismatchError on every process,
    naming the settings, the processes, and this process's values."""
    from jax.experimental import multihost_utils

    # Known to every process without a collective (the one below assumes equal counts, and failed
    # with NumPy's "cannot reshape array of size 6 into shape (2,4)").
    counts = collections.Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:
        each = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise JobMismatchError(
            f"the processes of this job have different numbers of devices ({each}); "
            "a multi-host job needs the same number on every process"
        )
    names = sorted(settings)
    blobs = [json.dumps(settings[k], sort_keys=True, default=str) for k in names]
    mine = np.asarray(
        [int.from_bytes(hashlib.blake2b(b.encode(), digest_size=4).digest(), "little", signed=True) for b in blobs],
        np.int32,
    )
    with peer_wait():
        everyone = np.asarray(multihost_utils.process_allgather(mine))  # [processes, settings]
    differ = [i for i in range(len(names)) if len(set(everyone[:, i].tolist())) > 1]
    if differ:
        own = jax.process_index()
        parts = []
        for i in differ:
            others = [p for p in range(len(everyone)) if everyone[p, i] != everyone[0, i]]
            parts.append(
                f"{names[i]} (processes {others} differ from process 0; here, on process {own}: {blobs[i][:200]})"
            )
        raise JobMismatchError(
            f"the processes of this job run different settings: {'; '.join(parts)}. "
            "Start every process with the same model and flags"
        )


def model_fingerprint(model: str | None) -> str:
    """What identifies a model's files without reading them whole: for a directory, every file's
    relative name, size and digest of its first and last 64 KiB (paths and dates may differ per host)."""
    if model is None or not os.path.isdir(str(model)):
        return str(model)
    h = hashlib.blake2b(digest_size=16)
    for root, dirs, files in os.walk(model):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            h.update(f"{os.path.relpath(path, model)}:{size};".encode())
            with open(path, "rb") as f:
                h.update(f.read(65536))
                if size > 65536:
                    f.seek(max(size - 65536, 65536))
                    h.update(f.read())
    return h.hexdigest()


def is_leader() -> bool:
    return jax.process_index() == 0


def _step_arrays(batch: Batch, targets: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """A step's inputs as broadcast: tokens, q_lens, kv_lens, the page table(s), the targets if any."""
    tables = (batch.page_table,) if batch.window_page_table is None else (batch.page_table, batch.window_page_table)
    extra = () if targets is None else (targets,)
    return tuple(np.asarray(x, np.int32) for x in (batch.tokens, batch.q_lens, batch.kv_lens, *tables, *extra))


def warm_step_broadcast(batch: Batch, targets: np.ndarray | None) -> None:
    """Every process, in the warm-up, for each step shape in the same order: broadcasts a step of
    this shape once. JAX compiles a broadcast per set of array shapes; left to the first step of
    each shape in service, every process would compile there, between a request's tokens."""
    from jax.experimental import multihost_utils

    with peer_wait():
        multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32))  # one program, compiled the first time
        multihost_utils.broadcast_one_to_all(_step_arrays(batch, targets))


class StepChannel:
    """The leader's step inputs, broadcast to every process (see the module docstring)."""

    def __init__(self):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.last_sent = time.monotonic()  # leader: when it last broadcast anything
        # The leader's --peer-timeout, sent in every header's last slot (ms; 0: none): a follower
        # bounds its waits by the leader's value, which sets how often an idle leader heartbeats.
        self.peer_timeout: float | None = None
        self.leader_peer_timeout: float | None = None  # follower: as last received

    def _send(self, header: list[int], payload: tuple[np.ndarray, ...]) -> None:
        head = np.zeros(_HEADER, np.int32)
        head[: len(header)] = header
        if self.peer_timeout is not None:
            head[_HEADER - 1] = min(max(1, round(self.peer_timeout * 1000)), 2**31 - 1)
        with peer_wait():
            self._broadcast(head)
            if payload:
                self._broadcast(payload)
        self.last_sent = time.monotonic()

    def send_step(self, batch: Batch, t: int, targets: np.ndarray | None = None) -> None:
        """A step's Batch, and the targets [B, t] of a prompt-logprobs step (see Engine._run_step)."""
        b, mp = batch.page_table.shape
        arrays = _step_arrays(batch, targets)
        num_tables = 1 if batch.window_page_table is None else 2
        self._send([OP_STEP, b, t, mp, num_tables, int(targets is not None)], arrays)

    def send_poison(self, pages: np.ndarray, group: int) -> None:
        self._send([OP_POISON, len(pages), group], (np.asarray(pages, np.int32),))

    def send_stop(self) -> None:
        self._send([OP_STOP], ())

    def send_heartbeat(self) -> None:
        """An idle leader's sign of life (the followers answer nothing; they go on waiting)."""
        self._send([OP_HEARTBEAT], ())

    def recv(self):
        """(op, payload) on a follower: (OP_STEP, (Batch, t, targets or None)), (OP_POISON, (pages, group)),
        (OP_HEARTBEAT, None) or (OP_STOP, None)."""
        with peer_wait():
            return self._recv()

    def _recv(self):
        head = np.asarray(self._broadcast(np.zeros(_HEADER, np.int32)))
        op = int(head[0])
        if head[_HEADER - 1] > 0:
            self.leader_peer_timeout = int(head[_HEADER - 1]) / 1000
        if op == OP_STEP:
            b, t, mp, num_tables, has_targets = (int(x) for x in head[1:6])
            shapes = ((b, t), (b,), (b,)) + ((b, mp),) * num_tables + ((b, t),) * has_targets
            tokens, q_lens, kv_lens, *tables = (
                np.asarray(x) for x in self._broadcast(tuple(np.zeros(s, np.int32) for s in shapes))
            )
            targets = tables.pop() if has_targets else None
            window_table = tables[1] if num_tables > 1 else None
            batch = Batch(
                tokens=tokens, q_lens=q_lens, kv_lens=kv_lens, page_table=tables[0], window_page_table=window_table
            )
            return op, (batch, t, targets)
        if op == OP_POISON:
            (pages,) = self._broadcast((np.zeros(int(head[1]), np.int32),))
            return op, (np.asarray(pages), int(head[2]))
        if op in (OP_STOP, OP_HEARTBEAT):
            return op, None
        raise PeerFailureError(f"unknown step op {op} from the leader")


def run_follower(engine, channel: StepChannel, watchdog: Watchdog | None = None) -> int:
    """A follower's whole life after warm-up: replay the leader's steps until it says stop.

    With a watchdog, its limit (the start-up one until then: the leader may still be warming up
    its sampler) becomes the leader's --peer-timeout, carried in every message, once the first
    arrives (sent when the leader starts serving): from then on the leader sends something at
    least every peer_timeout / 4 seconds (10 s at most), so a longer silence means it hung.

    Returns 0 on the leader's stop; raises PeerFailureError when the leader is gone.
    """
    while True:
        try:
            op, payload = channel.recv()
        except Exception as e:
            raise PeerFailureError(f"lost the leader: {type(e).__name__}: {e}") from e
        if watchdog is not None and channel.leader_peer_timeout is not None:
            watchdog.phase, watchdog.limit = "serving", channel.leader_peer_timeout
        if op == OP_STOP:
            return 0
        try:
            with peer_wait():
                if op == OP_STEP:
                    batch, t, targets = payload
                    jax.block_until_ready(engine._run_step(batch, t, targets=targets))
                elif op == OP_POISON:
                    engine._run_poison(*payload)
        except Exception as e:
            raise PeerFailureError(f"a step across the processes failed: {type(e).__name__}: {e}") from e
