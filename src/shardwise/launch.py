"""Start ranks: spawn N local processes on 127.0.0.1, or join a torchrun job.

Two ways in, one code path after ``init_distributed``:

- Embedded (no launcher): ``spawn(fn, world_size, args)`` starts ``world_size`` processes,
  each running ``fn(*args)`` after the process group is up. They fork from a fork server
  (multiprocessing's ``forkserver`` start method) that imported torch once (``PRELOAD``):
  a fresh interpreter per rank imports torch per rank (8 ranks up and joined on 2 cores:
  13-16 s; forked: 3.8-4.3 s the first time, the server starting, 1.4-1.5 s after;
  ``benchmarks/rank_start.py``), while the fork server is itself a fresh interpreter, so
  no rank inherits the launcher's threads, CUDA context or state. The server runs with the
  launcher's environment (a ``spawn`` after the environment changed starts a new one), and
  each rank writes to the launcher's standard output and error as they are at the call.
- torchrun: RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT
  are read from the environment (``rank_env_from_environ``) and nothing is spawned::

      torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
               --rdzv-endpoint 127.0.0.1:29500 -m shardwise train --parallel.dp 2

Local runs are safe by default:

- the rendezvous store (a ``TCPStore``) is hosted by the launcher on a socket bound to
  127.0.0.1 (handed to the store with ``master_listen_fd``), and gloo's own sockets are
  bound to the loopback interface (``GLOO_SOCKET_IFNAME=lo``, ``NCCL_SOCKET_IFNAME=lo``,
  unless set): nothing listens on another interface. Each ``spawn`` gets a fresh store
  and port, so a restarted gang never meets a stale peer. Under torchrun, its store is used.
- every rank asks the kernel to SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``;
  the parent is the fork server, which exits when the launcher does), and ignores SIGINT
  (Ctrl-C reaches the whole terminal's process group): the launcher alone decides,
  terminates the ranks, and prints one line. ``kill -9`` of the launcher leaves no rank
  (and no fork server) behind.

Each rank gets ``max(1, cores // local ranks)`` torch threads so ranks do not fight over
cores (on CUDA at most ``GPU_HOST_THREADS``: the GPU computes, the threads serve host
work), the local ranks being all those on this machine's cores (``share_cores``: under
torchrun, its agents on one machine together); one line warns when they outnumber the
cores. Each rank is named in ``ps``: ``shardwise rank R (dp d, tp t, pp p)``.

gloo can abort at interpreter exit after all work is done ("terminate called without an
active exception"), so a worker ends with ``destroy_process_group()`` and then
``os._exit(code)``: a good run never turns red at exit.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, reduction
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise import comm
from shardwise.base.errors import RunError, user_error_line

DEFAULT_TIMEOUT_S = 300.0
# what the fork server imports once for every rank it forks: torch, its process groups and
# dynamo (the tensor-parallel layers import it): 2.9 s of the 3.1 s a training rank spends
# importing here (shardwise itself: 0.2 s, imported by each rank); and base.fork_server,
# which has the server skip torch's teardown when the launcher is gone
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "shardwise.base.fork_server")
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits among all processes of the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


class WorkerError(RuntimeError):
    """A spawned rank failed; the message carries that rank's traceback, or one line when
    the rank raised a ``RunError`` (then ``fatal`` is true: a restart would fail the same way).
    ``usage``: the error is the user's to fix (``base.errors.user_error_line``: a setting
    the checkpoint contradicts, a full disk); ``traceback``: the rank's, as text (or None)."""

    def __init__(self, message: str, fatal: bool = False, usage: bool = False,
                 traceback: str | None = None):
        super().__init__(message)
        self.fatal, self.usage, self.traceback = fatal or usage, usage, traceback


class Interrupted(BaseException):
    """The launcher received SIGTERM or SIGINT; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


def rank_env_from_environ(environ=os.environ) -> RankEnv | None:
    """Return the torchrun-provided rank environment, or ``None`` when not under a launcher."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    world = int(environ["WORLD_SIZE"])
    return RankEnv(
        rank=int(environ["RANK"]),
        local_rank=int(environ.get("LOCAL_RANK", 0)),
        world_size=world,
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(environ.get("MASTER_PORT", 29500)),
    )


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


GPU_HOST_THREADS = 4  # a CUDA rank's host work: batches, the optimizer's launches, logging


def threads_per_rank(local_world_size: int, device_type: str = "cpu") -> int:
    """The torch intra-op threads one rank may use: ``max(1, cores // local ranks)`` on the
    CPU, where the rank computes with them; on CUDA the GPU computes and the threads only
    serve host work (batches, logging), so at most ``GPU_HOST_THREADS``."""
    share = max(1, available_cores() // max(1, local_world_size))
    return min(share, GPU_HOST_THREADS) if device_type == "cuda" else share


def machine_key() -> str:
    """What names the cores this process runs on: the kernel's boot id (every process of one
    machine shares it, in network and UTS namespaces too: two torchrun "nodes" on one host
    are one machine) and this process's CPU affinity (ranks pinned apart share nothing)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux
        boot = socket.gethostname()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"{boot} {cpus}"


def share_cores(env: RankEnv, device_type: str = "cpu", threads: int | None = None,
                warn: bool = True) -> int:
    """Collective, once the process group is up: count the ranks on this machine's cores
    (``machine_key``; at least ``env.local_world_size``), give this rank ``threads`` torch
    threads (None: ``threads_per_rank`` of that count, under torchrun too, whose
    LOCAL_WORLD_SIZE counts one agent's ranks only), and have the machine's first rank print
    one warning line when its ranks outnumber its cores (``warn``: a probe that measures
    exactly that, ``planner.hardware.shared_seconds``, turns it off). Returns the count."""
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, machine_key())
    mine = [r for r, k in enumerate(keys) if k == keys[dist.get_rank()]]
    local = max(len(mine), env.local_world_size)
    torch.set_num_threads(threads or threads_per_rank(local, device_type))
    cores = available_cores()
    if warn and local > cores and dist.get_rank() == mine[0]:
        print(f"shardwise: warning: {local} ranks on {cores} core{'s' if cores != 1 else ''} "
              "of this machine: they take turns on the cores, so step times do not measure "
              "the layout", file=sys.stderr, flush=True)
    return local


def rank_title(rank: int, coords: dict[str, int] | None = None) -> str:
    """A rank's process name: ``shardwise rank 3 (dp 1, tp 1, pp 0)``; ``coords``: its grid
    coordinates (``Topology.coords_of``), None: the rank alone."""
    if coords is None:
        return f"shardwise rank {rank}"
    return f"shardwise rank {rank} (dp {coords['dp']}, tp {coords['tp']}, pp {coords['pp']})"


def name_rank(title: str) -> None:
    """Show ``title`` as this process's name in ``ps`` and ``top`` (``setproctitle``); nothing
    when that package is not installed."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it before use).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A rendezvous store served by this process on 127.0.0.1 only, on a fresh port
    (``store.port``). The socket is bound here, so no other interface ever listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


def elastic_store(env: RankEnv, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Under torchrun (its agent serves the store): a client of that store whose keys are
    prefixed by ``TORCHELASTIC_RESTART_COUNT``, else ``None``.

    torch reuses the agent's store across restarts without a per-attempt prefix, so a
    restarted gang's gloo ``connectFullMesh`` can read a dead peer's address from the
    previous attempt and hang or be refused; a fresh prefix per attempt gives it fresh keys.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                         timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"shardwise/attempt_{attempt}/", base)


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies; exit now if the
    launcher (``parent_pid``) is already gone (killed while this process was starting).

    The parent is the launcher under the ``spawn`` start method (the kernel watches the
    thread that started the process, so ``spawn`` belongs on a thread that lives as long as
    the ranks: the main thread, in the CLI) and the fork server under ``forkserver``. The
    fork server runs while any holder of its "alive" pipe lives; a forked rank inherits one
    end and drops it here, so the server exits with the launcher, and the rank with it."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _leave_fork_server()
    if os.getppid() == parent_pid:
        return
    launcher = mp.parent_process()  # its sentinel: a pipe the launcher holds open until it ends
    if launcher is None or not launcher.is_alive():
        os._exit(1)


def _leave_fork_server() -> None:
    """Close the fork server's "alive" pipe that a forked process inherits (nothing when this
    process was not forked by one): a rank never starts processes through that server. Drop
    the server's exit at interpreter shutdown too (``base.fork_server``), inherited with it."""
    import atexit
    from multiprocessing import forkserver
    atexit.unregister(os._exit)
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


class _LauncherFd:
    """One of the launcher's file descriptors, duplicated into a forked rank as it starts
    (``multiprocessing.reduction.DupFd``: over the fork server's socket); ``None`` for a
    closed descriptor."""

    def __init__(self, fd: int):
        try:
            os.fstat(fd)
            self.fd: int | None = fd
        except OSError:
            self.fd = None

    def __reduce__(self):
        return _LauncherFd._rebuild, (None if self.fd is None else reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> int | None:
        return None if dup is None else dup.detach()


class DeviceError(ValueError):
    """The requested device cannot serve this many local ranks (one line, names the field)."""


def pick_device(requested: str, local_ranks: int, gpus: int | None = None,
                backend: str = "auto") -> tuple[str, str | None]:
    """``(device type, note)`` for ``training.device`` = auto | cpu | cuda with
    ``local_ranks`` ranks on this host and ``parallel.backend`` = auto | nccl | gloo.

    With NCCL (the CUDA default) every local rank needs its own GPU (NCCL refuses two ranks
    on one GPU: "Duplicate GPU detected"); ``auto`` then takes CUDA when there are enough
    GPUs, else the CPU with gloo, and ``note`` says why in one line when GPUs were there.
    ``cuda`` with ``backend = "gloo"`` lets the local ranks share the GPUs (rank i on GPU
    i mod count): a test mode, every CUDA tensor crossing ranks through host memory
    (``comm.primitives.HostCopy``); ``auto`` with gloo is the CPU. Raises ``DeviceError``
    (one line, naming the field) for ``cuda`` without a GPU, or without enough GPUs for NCCL."""
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and backend == "gloo"):
        return "cpu", None
    if requested == "cuda" and not gpus:
        raise DeviceError("training.device=cuda: CUDA is not available on this machine "
                          "(torch.cuda.is_available() is false); use --training.device cpu")
    if requested == "cuda" and backend == "gloo":
        return "cuda", None
    if gpus >= local_ranks:
        return ("cuda", None) if gpus else ("cpu", None)
    why = (f"{local_ranks} local ranks but {gpus} GPU{'s' if gpus != 1 else ''} "
           "(NCCL refuses two ranks on one GPU)")
    if requested == "cuda":
        hint = " or --parallel.backend gloo (ranks share a GPU, for testing)" if gpus else ""
        raise DeviceError(f"training.device=cuda: {why}; use at most {gpus} ranks per host, "
                          f"--training.device cpu{hint}")
    if gpus == 0:
        return "cpu", None
    return "cpu", f"shardwise: training on the CPU with gloo: {why}; at most {gpus} ranks " \
                  "per host train on CUDA"


def rank_device(requested: str = "auto") -> torch.device:
    """The device this process computes on, once ``init_distributed`` has run (or in one
    process): CUDA's current device for ``training.device = "cuda"``, or for "auto" when the
    world's backend is NCCL; otherwise the CPU."""
    if requested == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if requested == "auto" and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(env: RankEnv, timeout_s: float = DEFAULT_TIMEOUT_S,
                     threads: int | None = None, store=None,
                     device: str = "auto", backend: str = "auto",
                     warn_shared_cores: bool = True) -> torch.device:
    """Set threads, pick backend (NCCL on CUDA, gloo on the CPU), join the process group.

    ``store``: an already connected rendezvous store (local runs); ``None`` rendezvouses at
    ``tcp://MASTER_ADDR:MASTER_PORT`` (torchrun). ``device``: "cpu", "cuda" or "auto";
    ``backend``: "auto", "nccl" or "gloo" (``pick_device``). Returns the device this rank
    computes on.
    """
    kind = pick_device(device, env.local_world_size, backend=backend)[0]
    torch.set_num_threads(threads or threads_per_rank(env.local_world_size, kind))
    name_rank(rank_title(env.rank))
    if kind == "cuda":
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "gloo" if backend == "gloo" else "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        where = ({"store": store} if store is not None
                 else {"init_method": f"tcp://{env.master_addr}:{env.master_port}"})
        if backend == "nccl":  # NCCL binds the communicator to this GPU, not a guess
            where["device_id"] = device
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s), **where)
        # torchrun's "nodes" on one machine share its cores
        share_cores(env, kind, threads, warn_shared_cores)
    return device


def shutdown(clean: bool = True) -> None:
    """Finish shardwise.comm's queued collectives (when ``clean``) and leave the process group.

    After a failure, queued collectives may wait on a dead peer, so they are abandoned.
    """
    if clean:
        comm.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _take_launchers_stdio(stdout: int | None, stderr: int | None) -> None:
    """Write to the launcher's standard output and error as they were when it called
    ``spawn`` (a forked rank starts with the fork server's, from when the server started)."""
    for fd, target in ((stdout, 1), (stderr, 2)):
        if fd is not None and fd != target:
            os.dup2(fd, target)
            os.close(fd)


_server_environ: dict | None = None
_server_lock = threading.Lock()
_running = 0  # spawn calls whose ranks are running (a new server would kill them)
# variables that describe the launcher, not its ranks: pytest rewrites this one at every
# phase of every test, and a new server per test would cost each test the imports again
LAUNCHER_ONLY_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def _start_context():
    """The multiprocessing context ``spawn`` starts ranks with: the fork server (``PRELOAD``
    imported), restarted when this process's environment changed since it started, so a
    rank always sees the launcher's current environment, as a spawned process does (also
    what the C library reads once at exec: ``GLIBC_TUNABLES``, ``LD_PRELOAD``), but for
    ``LAUNCHER_ONLY_ENV`` and while another thread's ``spawn`` has ranks running (they
    would die with the server); counts the caller in ``_running`` until it calls
    ``_done``. ``spawn`` where there is no fork server (Windows)."""
    global _server_environ, _running
    if START_METHOD != "forkserver":
        return mp.get_context(START_METHOD)
    from multiprocessing import forkserver
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ONLY_ENV}
    with _server_lock:
        stop = getattr(forkserver._forkserver, "_stop", None)  # (CPython 3.4 to 3.14)
        if _server_environ is not None and environ != _server_environ and not _running and stop:
            stop()  # no rank of it is running: it exits now
            _server_environ = None
        if _server_environ is None:
            _server_environ = environ
        _running += 1
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _done(ctx) -> None:
    """The ranks of a ``spawn`` started with ``ctx`` have ended (see ``_start_context``)."""
    global _running
    if ctx.get_start_method() == "forkserver":
        with _server_lock:
            _running -= 1


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence,
            conn, threads: int | None, timeout_s: float, parent_pid: int,
            device: str = "cpu", backend: str = "auto",
            stdio: tuple = (None, None), warn_shared_cores: bool = True) -> None:
    die_with_parent(parent_pid)
    _take_launchers_stdio(*stdio)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    code = 0
    try:
        env = RankEnv(rank, rank, world_size, world_size, "127.0.0.1", port)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # listen on loopback only
            os.environ.setdefault(var, "lo")
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        init_distributed(env, timeout_s=timeout_s, threads=threads, store=store, device=device,
                         backend=backend, warn_shared_cores=warn_shared_cores)
        result = fn(*args)
        conn.send(("ok", _to_bytes(result)))
    except BaseException as e:  # report everything, including SystemExit from a worker
        code = 1
        tb = traceback.format_exc()
        line = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else user_error_line(e)
        if line is not None:  # the user's to fix (exit 2 in the CLI): one line
            report = ("usage", line, tb)
        elif isinstance(e, RunError):  # one line for the user; no restart would help
            report = ("fatal", str(e), tb)
        else:
            report = ("error", tb)
        try:
            conn.send(report)
        except Exception:
            pass
    finally:
        try:
            shutdown(clean=code == 0)
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        conn.close()
        os._exit(code)


def spawn(fn: Callable, world_size: int, args: Sequence = (), *, threads: int | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float | None = None,
          device: str = "auto", backend: str = "auto",
          warn_shared_cores: bool = True) -> list:
    """Run ``fn(*args)`` on ``world_size`` new local ranks (forked from the fork server: see
    the module's docstring); return each rank's result.

    ``fn`` must be importable (module-level). Results travel back through ``torch.save``
    and are loaded with ``weights_only=True``: return tensors, numbers, strings, lists and
    dicts. Raises ``WorkerError`` with the first failing rank's traceback; the other ranks
    are terminated so nothing hangs. Any exception in the launcher itself (``Interrupted``,
    ``KeyboardInterrupt``) also terminates every rank before it propagates. ``device``: as
    ``init_distributed``; "auto" falls back to the CPU when there are fewer GPUs than ranks.
    ``backend``: as ``init_distributed`` ("gloo" with ``device="cuda"``: the ranks share
    the GPUs). ``warn_shared_cores``: False keeps ``share_cores``' warning that the ranks
    outnumber the cores unsaid (for a probe that measures exactly that). Raises
    ``DeviceError`` for "cuda" without enough GPUs, before any rank starts.
    """
    device, _ = pick_device(device, world_size, backend=backend)
    # a spawned rank inherits them; a forked one gets them passed (the server's are older)
    stdio = ((_LauncherFd(1), _LauncherFd(2)) if START_METHOD == "forkserver"
             else (None, None))
    store = loopback_store(timeout_s)  # fresh port per call: a restart meets no stale peer
    port = store.port
    pipes, procs = [], []
    results: list = [None] * world_size
    deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
    error: str | None = None
    fatal = usage = False
    rank_tb: str | None = None
    clean = False
    ctx = _start_context()  # counts this call in _running until the finally below
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, child,
                                                  threads, timeout_s, os.getpid(), device,
                                                  backend, stdio, warn_shared_cores),
                            daemon=False)
            procs.append(p)
            p.start()
            child.close()
            pipes.append(parent)
        pending = {pipes[r]: r for r in range(world_size)}
        while pending and error is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait(list(pending), timeout=remaining)
            if not ready:
                error = f"ranks {sorted(pending.values())} did not finish within {join_timeout_s}s"
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, payload, *tb = conn.recv()
                except EOFError:
                    procs[rank].join(5)
                    error = f"rank {rank} died with exit code {procs[rank].exitcode}"
                    break
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=True)
                elif status in ("fatal", "usage"):
                    error, fatal, usage = f"rank {rank}: {payload}", True, status == "usage"
                    rank_tb = tb[0] if tb else None
                    break
                else:
                    error, rank_tb = f"rank {rank} failed:\n{payload}", payload
                    break
        clean = error is None
    finally:  # also on Interrupted / KeyboardInterrupt in this process: no rank outlives us
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if not clean and p.is_alive():
                p.terminate()
        for p in started:
            p.join(30 if clean else 5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
        _done(ctx)
    if error is not None:
        raise WorkerError(error, fatal=fatal, usage=usage, traceback=rank_tb)
    return results
