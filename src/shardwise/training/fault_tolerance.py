"""Per-step fault tolerance across replica groups, with torchft underneath.

Each replica group (any layout inside it) is a fault domain and one torchft ``Manager``
(https://github.com/pytorch/torchft). A step is::

    step = ft.start_step()          # the quorum of live replica groups; a replica that is
                                    # behind heals here (parameters, optimizer state, step)
    ... forward, backward, in-replica reduction ...
    ft.replicas.average_(grads)     # the mean over the live replica groups
    if ft.commit():                 # True only if every live replica finished the step
        optimizer.step()

A step that does not commit is redone at the same step number, so its samples are not lost
(the sampler position is the committed step). A pause between two steps (a checkpoint, a
validation) comes after the next step's ``start_step``: the lighthouse forms a quorum
without a heartbeating replica that has not asked within its ``join_timeout_ms``, and such
a replica would heal and skip its slot of the steps it missed; inside the step its peers
wait for it (``process_group_timeout_ms``). ``state_dict()``: torchft's step and slot
counters, which checkpoints hold. The heal copies what ``state_dict`` returns
from a live peer through torchft's checkpoint transport over the replica process group
(``PGTransport``), reading no file. ``Lighthouse`` starts the coordinator of a local run on
loopback (torchft's ``torchft_lighthouse`` binds every interface, ``[::]:29510``); across
machines it is started once and given by ``fault_tolerance.lighthouse``. docs/reliability.md
says how a job behaves when a replica or the lighthouse is lost. ``shardwise train`` drives
it from ``apps.lm.trainer`` (the engine calls ``replicas.commit()`` before its optimizer
step); ``tests/ft_workers.py`` is the same protocol around a toy model."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.base.config import FaultToleranceConfig
from shardwise.base.errors import RunError
from shardwise.comm.torchft_replicas import TorchftReplicas


def _quiet_torchft() -> None:
    """torchft logs every quorum and vote (its Rust side at info, ``RUST_LOG``: warnings
    kept unless set), warns about NCCL's flight recorder on the CPU and logs a failed
    collective with its traceback: ``commit`` says it in one line instead."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", module="torchft.checkpointing.pg_transport")


def _ms(ms: int) -> timedelta:
    return timedelta(milliseconds=ms)


class QuorumError(RunError):
    """No quorum within ``fault_tolerance.quorum_timeout_ms`` (the lighthouse lost or
    unreachable), or a commit vote of this replica group that did not complete; ``str(err)``
    is one line. The job's checkpoints cover this case."""


class Lighthouse:
    """torchft's lighthouse (the quorum's coordinator) in this process, bound to ``host``
    (loopback by default: a local run listens on no other interface). ``address``:
    ``http://HOST:PORT``, what ``fault_tolerance.lighthouse`` takes. A context manager."""

    def __init__(self, min_replicas: int, join_timeout_ms: int = 1000,
                 heartbeat_timeout_ms: int = 5000, host: str = "127.0.0.1", port: int = 0):
        _quiet_torchft()
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(bind=f"{host}:{port}", min_replicas=min_replicas,
                                        join_timeout_ms=join_timeout_ms,
                                        heartbeat_timeout_ms=heartbeat_timeout_ms)
        # its own address() names the machine's hostname, which may not resolve to `host`
        self.address = f"http://{host}:{self._server.address().rsplit(':', 1)[1]}"

    @classmethod
    def for_config(cls, cfg: FaultToleranceConfig) -> "Lighthouse":
        return cls(cfg.min_replica_size, cfg.join_timeout_ms, cfg.heartbeat_timeout_ms)

    def shutdown(self) -> None:
        self._server.shutdown()

    def __enter__(self) -> "Lighthouse":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@contextlib.contextmanager
def _manager_server_bound_to(host: str | None):
    """torchft's Manager binds its server to ``[::]`` (every interface), with no option:
    have it bind to ``host`` instead while one Manager is built (a local run: loopback)."""
    import torchft.manager as tm

    if host is None:
        yield
        return
    original = tm.ManagerServer

    def bound(**kw):
        kw["bind"] = f"{host}:{kw['bind'].rsplit(':', 1)[1]}"
        return original(**kw)

    tm.ManagerServer = bound
    try:
        yield
    finally:
        tm.ManagerServer = original


@contextlib.contextmanager
def _one_line(cfg: FaultToleranceConfig, what: str):
    """torchft's errors (a lighthouse that does not answer: a Rust error with its chain of
    causes) as one ``QuorumError`` line naming the replica and the lighthouse."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        raise QuorumError(f"replica {cfg.replica_id}: {what}: the lighthouse "
                          f"{cfg.lighthouse}: {str(exc).splitlines()[0][:200]}") from None


class FaultTolerantReplica:
    """This rank's part of one replica group of a torchft job.

    ``state_dict()`` / ``load_state_dict(sd)``: what a healing replica copies from a live
    peer (parameters, optimizer state; the step travels in torchft's own state).
    ``store_addr``/``store_port``: a ``TCPStore`` served by the replica group's rank 0 (the
    group's own rendezvous store). ``hostname``: how the other replica groups reach this
    one. ``bind``: the host the Manager's server binds (None: torchft's every interface).
    ``log``: one line per change of the quorum and per heal (which replica, which step).
    The lighthouse is ``cfg.lighthouse``."""

    def __init__(self, cfg: FaultToleranceConfig, *, state_dict: Callable[[], Any],
                 load_state_dict: Callable[[Any], None], device: torch.device,
                 store_addr: str, store_port: int, hostname: str,
                 group_rank: int = 0, group_world_size: int = 1, bind: str | None = None,
                 log: Callable[[str], None] = print):
        if not cfg.lighthouse:
            raise ValueError("fault_tolerance.lighthouse: the lighthouse's address is needed "
                             "(a local run: Lighthouse(...).address)")
        _quiet_torchft()
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.cfg, self.log = cfg, log
        timeout = _ms(cfg.process_group_timeout_ms)
        pg = ProcessGroupNCCL(timeout) if device.type == "cuda" else ProcessGroupGloo(timeout)
        self._load, self._state, self.device = load_state_dict, state_dict, device
        self._group_world_size = group_world_size
        with _manager_server_bound_to(bind), _one_line(cfg, "cannot join the job"):
            self.manager = Manager(
                pg=pg, load_state_dict=self._heal, state_dict=state_dict,
                min_replica_size=cfg.min_replica_size, use_async_quorum=False,
                # no heal at step 0: every replica group starts from the same seed; torchft's
                # step-0 sync picks a source per rank, healing some ranks of a group and not
                # others, which a load's in-group collectives (ZeRO's all-gather) cannot follow
                init_sync=False,
                timeout=timeout, quorum_timeout=_ms(cfg.quorum_timeout_ms),
                connect_timeout=timeout, quorum_retries=cfg.quorum_retries,
                rank=group_rank, world_size=group_world_size,
                store_addr=store_addr, store_port=store_port, lighthouse_addr=cfg.lighthouse,
                replica_id=f"replica_{cfg.replica_id}", hostname=hostname,
                checkpoint_transport=PGTransport(pg, timeout=timeout, device=device))
        self.replicas = TorchftReplicas(self.manager, vote=self.commit)
        self._live, self._redone = 0, -1
        self._joined = False  # in a quorum whose step has not been voted on yet
        self._checked = -1  # the last quorum id ``_new_quorum`` answered for

    def _heal(self, state: Any) -> None:
        self._load(state)
        self.log(f"replica {self.cfg.replica_id}: healed from a live peer at step "
                 f"{self.step} (parameters, optimizer state, step; no checkpoint read)")

    @property
    def step(self) -> int:
        """Steps committed so far (the sampler position: step s reads global batch s)."""
        return self.manager.current_step()

    @property
    def batches_committed(self) -> int:
        """Replica-group slots of the global batch trained so far: each committed step adds
        the replica groups live at it (torchft's count; all of them while none is missing)."""
        return self.manager.batches_committed()

    def state_dict(self) -> dict[str, int]:
        """torchft's counters (``Manager.state_dict``): ``step`` and ``batches_committed``;
        a checkpoint holds them, so a job resumed from it counts on as an uninterrupted
        one."""
        return self.manager.state_dict()

    def load_state_dict(self, counters: dict[str, int]) -> None:
        """Restore ``state_dict()``'s counters (a job resumed from its checkpoint: every
        replica group resumed at the same step agrees on it; one behind heals)."""
        self.manager.load_state_dict(counters)

    def start_step(self) -> int:
        """Join this step's quorum (healing first where this replica is behind); returns
        the step number. At a new quorum the live groups' states are compared and averaged
        where they differ (``_reconcile``). Again before ``commit``: nothing more, the quorum
        is kept (the loop joins the next step before a checkpoint or a validation:
        ``TrainTask.join_next_step``)."""
        if self._joined:
            return self.step
        try:
            self.manager.start_quorum()
        except Exception as exc:  # torchft raises the RPC's TimeoutError / RuntimeError
            raise QuorumError(
                f"replica {self.cfg.replica_id}: step {self.step}: no quorum from the "
                f"lighthouse {self.cfg.lighthouse} within "
                f"{self.cfg.quorum_timeout_ms} ms, {self.cfg.quorum_retries} retries: "
                f"{str(exc).splitlines()[0][:200]}") from None
        live = self.manager.num_participants()
        if live != self._live:
            verb = "lost" if live < self._live else "joined"
            what = f"a replica group {verb}: " if self._live else ""
            self.log(f"replica {self.cfg.replica_id}: step {self.step}: {what}{live} of "
                     f"{self.cfg.group_size} replica groups live")
            self._live = live
        self._joined = True
        if self._new_quorum():
            self._reconcile()
        return self.step

    def _new_quorum(self) -> bool:
        """True once per new quorum of two or more live replica groups: torchft's quorum id
        changes with the quorum's members, so every member of a new quorum sees it change at
        the same step (``Manager._quorum_id``, kept private by torchft 0.2.0; set where the
        Manager reconfigures)."""
        quorum = self.manager._quorum_id
        if quorum == self._checked:
            return False
        self._checked = quorum
        return self.manager.num_participants() > 1

    def _reconcile(self) -> None:
        """At a new quorum: do the live replica groups hold the same state? One sum per
        floating tensor of this rank's ``state_dict()`` (what a heal copies), compared with
        the same rank of every live group (``TorchftReplicas.agree``), then across this
        group's ranks. Where any differ, each of those tensors (parameters, optimizer state)
        becomes its mean over the live groups (``load_state_dict``), and one line says so.
        Why: torchft 0.2.0 never compares replicas; two quorums committing the same step (the
        lighthouse counts a group whose heartbeats lapsed as dead: a quorum of one beside one
        of two, seen in the soak, docs/reliability.md), or a group started from other
        weights (no step-0 sync, ``init_sync=False``), would otherwise train apart for ever
        at the same step count."""
        state = self._state()
        floats = [t for t in _leaves(state) if t.is_floating_point()]
        # on the run's device, wherever each tensor is (offload: masters on the host): the
        # replicas' process group is NCCL's on CUDA
        sums = (torch.stack([t.detach().double().sum().to(self.device) for t in floats])
                if floats else torch.zeros(1, dtype=torch.float64, device=self.device))
        differ = torch.tensor([0 if self.replicas.agree(sums) else 1], device=self.device)
        if self._group_world_size > 1 and dist.is_initialized():  # the group acts as one
            comm.all_reduce(differ, op="max", check=False)
        if not differ.item():
            return
        self.replicas.average_(floats)
        self._load(state)
        self.log(f"replica {self.cfg.replica_id}: step {self.step}: its state differed from "
                 f"the other live replica groups'; parameters and optimizer state averaged "
                 f"over the {self.replicas.size} live groups")

    def commit(self) -> bool:
        """The step's vote: True (step the optimizer) only if every live replica finished
        it without error; False everywhere otherwise (the step is redone)."""
        step, live = self.step, self.manager.num_participants()
        self._joined = False  # the next step asks for a new quorum
        try:
            ok = self.manager.should_commit()
        except (RuntimeError, TimeoutError) as exc:  # a rank of this group did not vote
            raise QuorumError(f"replica {self.cfg.replica_id}: step {step}: the commit vote "
                              f"of this replica group did not complete within "
                              f"{self.cfg.process_group_timeout_ms} ms: "
                              f"{str(exc).splitlines()[0][:200]}") from None
        if not ok and step != self._redone:  # one line per step, however often it is redone
            err = self.manager.errored()
            why = (str(err.original_exception).splitlines()[0] if err
                   else f"{live} live, fewer than fault_tolerance."
                   f"min_replica_size={self.cfg.min_replica_size}"
                   if live < self.cfg.min_replica_size else "a peer failed it")
            self.log(f"replica {self.cfg.replica_id}: step {step} not committed, redone: "
                     f"{why[:200]}")
            self._redone = step
        return ok

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _leaves(tree) -> list[torch.Tensor]:
    """The tensors of nested dicts, lists and tuples, in order (the same on every replica
    group of one layout)."""
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _leaves(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []
