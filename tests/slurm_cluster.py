"""A real Slurm cluster of one or two nodes on this machine, for tests and benchmarks.

``with slurm_cluster() as cluster:`` starts munged, slurmctld and slurmd (Debian's
``slurm-wlm`` and ``munge`` packages) in network namespaces of their own, with addresses
that exist only there, so nothing they open is reachable from outside the machine and their
ports cannot clash with anyone's; ``slurm_cluster(nodes=2)`` makes two nodes, a namespace
each joined by a veth pair, one slurmd in each. Everything they need lives in one temporary
directory: a fresh munge key, ``slurm.conf`` (``SLURM_CONF`` points every client command at
it, so the machine's own Slurm set-up, if any, is neither read nor touched), state, spool
and logs. No cgroups: ``proctrack/linuxproc``, ``task/none``, no accounting. On exit, also
when the test failed: every job cancelled, the daemons stopped, every process left in the
namespaces (job steps, ranks) killed, the namespaces and the directory removed. Every wait
is bounded. ``unavailable()`` says why it cannot run here (packages absent, not root, no
``ip netns``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun")
START_TIMEOUT_S = 60.0  # each daemon up
CALL_TIMEOUT_S = 30.0  # one client command
STOP_TIMEOUT_S = 15.0  # a daemon gone after SIGTERM, then SIGKILL
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None]
    if missing:
        return (f"needs Slurm and munge (Debian: apt-get install slurm-wlm munge): "
                f"{', '.join(missing)} not found")
    if os.geteuid() != 0:
        return "a test Slurm cluster runs its daemons as root"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return ("the test Slurm cluster runs in a network namespace: needs iproute2's ip "
                "and util-linux's nsenter")
    probe = f"swslprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=CALL_TIMEOUT_S)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CALL_TIMEOUT_S)
    if made.returncode != 0:
        return f"ip netns add failed here: {made.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Node:
    name: str  # Slurm's NodeName (slurmd -N); resolves nowhere: NodeAddr is the address
    netns: str  # its network namespace, unique per run
    addr: str  # NodeAddr: 127.0.0.1 for one node, else its address on the pair of veths


def slurm_conf(root: Path, nodes: Sequence[Node], cpus: int) -> str:
    """``nodes`` of ``cpus`` CPUs each, the controller on the first one's address (named as
    this machine: slurmctld checks its host name), one partition, no cgroups; each slurmd's
    spool, pid and log files named by its node (``%n``)."""
    head, names = nodes[0], ",".join(n.name for n in nodes)
    node_lines = "".join(f"NodeName={n.name} NodeAddr={n.addr} CPUs={cpus} State=UNKNOWN\n"
                         for n in nodes)
    return f"""\
ClusterName=shardwise-test
MailProg=/bin/true
SlurmctldHost={socket.gethostname().split(".")[0]}({head.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
MinJobAge=600
{node_lines}PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    """A running cluster: client commands (run on the first node), submissions, waits."""

    root: Path
    nodes: list[Node]
    env: dict[str, str]
    spare: str = ""  # one node: the address of its namespace's veth (Slurm never uses it)
    _daemons: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str], node: Node | None = None) -> list[str]:
        # nsenter, not `ip netns exec`: that one also mounts a fresh /sys, without the
        # cgroup filesystem slurmd looks for at start even with no cgroup plugin configured
        return ["nsenter", f"--net=/run/netns/{(node or self.nodes[0]).netns}", "--", *argv]

    def run(self, argv: Sequence[str], timeout: float = CALL_TIMEOUT_S,
            check: bool = True, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        done = subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, env=env or self.env)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()}")
        return done

    def sbatch(self, script: Path, options: Sequence[str], args: Sequence[str] = (),
               env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit ``script`` with sbatch ``options`` and ``args`` for the script, the job's
        environment ``env`` on top of the cluster's (sbatch exports it); returns the job id."""
        job_env = dict(self.env, **(env or {}))
        chdir = [f"--chdir={cwd}"] if cwd is not None else []
        out = self.run(["sbatch", "--parsable", *chdir, *options, str(script), *args],
                       env=job_env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (JobState, ExitCode, StdOut...)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "?")

    def wait(self, job_id: int, states: Sequence[str], timeout: float) -> str:
        """Poll until the job's state is one of ``states`` (or it ended); returns it."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in states or state in ENDED:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")
            time.sleep(0.5)

    def wait_gone(self, job_id: int, timeout: float) -> None:
        """Until no process of the job is left (squeue lists it neither running nor
        completing); ``scancel`` returns before its steps have stopped."""
        deadline = time.monotonic() + timeout
        while self.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still listed after {timeout:.0f} s")
            time.sleep(0.5)

    def cancel(self, job_id: int) -> None:
        self.run(["scancel", str(job_id)])

    def logs(self) -> str:
        """The daemons' logs, for a failure message."""
        parts = []
        for p in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "log"]:
            with contextlib.suppress(OSError):
                parts.append(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-20:]))
        return "\n".join(parts)

    def _start(self, argv: Sequence[str], ready, what: str, node: Node | None = None) -> None:
        err = self.root / "log" / f"{what}.stderr"
        with open(err, "w") as f:  # a file, not a pipe: nobody reads a pipe while it runs
            proc = subprocess.Popen(self.command(argv, node), env=self.env, stdout=f, stderr=f)
        self._daemons.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited {proc.returncode}: "
                                   f"{err.read_text().strip()}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {START_TIMEOUT_S:.0f} s\n"
                                   f"{self.logs()}")
            time.sleep(0.2)

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=CALL_TIMEOUT_S)

    def _network(self) -> None:
        """Each node's namespace, loopback up. One node: a veth pair with both ends inside
        its namespace (Slurm resolves 127.0.0.1 with AI_ADDRCONFIG, which finds nothing
        where loopback is the only interface). Two: one veth pair between them, an address
        in a private /24 on each end; nothing leaves these namespaces."""
        for n in self.nodes:
            self._ip("netns", "add", n.netns)
            self._ip("-n", n.netns, "link", "set", "lo", "up")
        first, last = self.nodes[0], self.nodes[-1]
        self._ip("link", "add", "sl0", "netns", first.netns, "type", "veth", "peer", "name",
                 "sl1", "netns", last.netns)
        ends = [(first, "sl0"), (last, "sl1")]
        for i, (n, link) in enumerate(ends):
            if len(self.nodes) > 1:
                self._ip("-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", link)
            elif i == 0:
                self._ip("-n", n.netns, "addr", "add", f"{self.spare}/30", "dev", link)
            self._ip("-n", n.netns, "link", "set", link, "up")

    def start(self, cpus: int) -> None:
        root = self.root
        for d in ("munge", "state", "spool", "log"):
            (root / d).mkdir()
        for n in self.nodes:
            (root / "spool" / n.name).mkdir()
        os.chmod(root, 0o755)  # munged: every directory above its socket searchable
        os.chmod(root / "munge", 0o755)
        key = root / "munge" / "key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        (root / "slurm.conf").write_text(slurm_conf(root, self.nodes, cpus))
        self._network()
        m = root / "munge"  # one munged: its socket is a file, reached from every namespace
        self._start(["munged", "-F", f"--socket={m}/socket", f"--key-file={m}/key",
                     f"--pid-file={m}/pid", f"--log-file={m}/log", f"--seed-file={m}/seed"],
                    lambda: (m / "socket").exists(), "munged")
        self._start(["slurmctld", "-D"], lambda: self.run(
            ["scontrol", "ping"], check=False).stdout.count("UP") > 0, "slurmctld")
        for i, n in enumerate(self.nodes):
            self._start(["slurmd", "-D", "-N", n.name], lambda: self.run(
                ["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split().count("idle")
                > i, f"slurmd-{n.name}", node=n)

    def close(self) -> None:
        """Cancel every job, stop the daemons, kill what is left in the namespace, remove
        the namespace and the directory; safe to call twice, never raises."""
        if self._daemons and self._daemons[-1].poll() is None:
            with contextlib.suppress(Exception):
                self.run(["scancel", "--user", "root"], check=False)
        for proc in reversed(self._daemons):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=STOP_TIMEOUT_S)
        for n in self.nodes:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while time.monotonic() < deadline:  # job steps and ranks slurmd left behind
                pids = subprocess.run(["ip", "netns", "pids", n.netns], capture_output=True,
                                      text=True, timeout=CALL_TIMEOUT_S).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", n.netns], capture_output=True,
                           timeout=CALL_TIMEOUT_S)
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class Interrupted:
    """What ``requeue_cancel_resubmit`` saw: each job's id, final state and output, and the
    newest complete checkpoint at each interruption."""

    first: int
    first_state: str
    first_log: str  # both attempts of the first job (sbatch --open-mode=append)
    requeued_at: int  # the newest checkpoint's step once the requeued attempt had stopped
    saved: int  # the newest checkpoint's step once the cancelled job was gone
    second: int
    second_state: str
    second_log: str


def _checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*[0-9]"))


def _until(what: str, done, job: int, cluster: Cluster, log: Path, timeout: float) -> None:
    """Poll ``done()`` while ``job`` is pending or running, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not done():
        state = cluster.state(job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED"):
            raise RuntimeError(f"job {job} {state} before {what}:\n{_read(log)}\n"
                               f"{cluster.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job}: no {what} after {timeout:.0f} s\n{_read(log)}")
        time.sleep(0.2)


def requeue_cancel_resubmit(cluster: Cluster, script: Path, options: Sequence[str],
                            args: Sequence[str], env: dict[str, str], out: Path, logs: Path,
                            cwd: Path, timeout: float) -> Interrupted:
    """Submit ``script``. Once its run ``out`` holds a checkpoint, ``scontrol requeue`` it
    (Slurm stops it and runs it again under the same job id; its 120 s hold lifted with
    ``scontrol update StartTime=now``); once the requeued attempt has written a newer
    checkpoint, ``scancel`` it and wait until it is gone; submit it again, the same way, and
    wait until it ends. The output must go to ``logs/slurm-%j.out``, appended (the script's
    ``--open-mode=append``). Each wait at most ``timeout`` s."""
    first = cluster.sbatch(script, options, args, env, cwd=cwd)
    log = logs / f"slurm-{first}.out"
    _until("its first checkpoint", lambda: _checkpoint_steps(out), first, cluster, log, timeout)
    cluster.run(["scontrol", "requeue", str(first)])
    deadline = time.monotonic() + timeout
    while cluster.state(first) != "PENDING":  # the first attempt has stopped
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {first} not pending after its requeue\n{_read(log)}")
        time.sleep(0.2)
    requeued_at = _checkpoint_steps(out)[-1]
    cluster.run(["scontrol", "update", f"JobId={first}", "StartTime=now"])
    _until("a checkpoint after its requeue", lambda: _checkpoint_steps(out)[-1] > requeued_at,
           first, cluster, log, timeout)
    cluster.cancel(first)
    cluster.wait_gone(first, timeout=60)
    first_state, saved = cluster.state(first), _checkpoint_steps(out)[-1]
    second = cluster.sbatch(script, options, args, env, cwd=cwd)
    cluster.wait(second, ("COMPLETED",), timeout=timeout)
    cluster.wait_gone(second, timeout=60)
    return Interrupted(first, first_state, _read(log), requeued_at, saved, second,
                       cluster.state(second), _read(logs / f"slurm-{second}.out"))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        return f"({path}: {e.strerror})"


@contextlib.contextmanager
def slurm_cluster(cpus: int = 2, nodes: int = 1) -> Iterator[Cluster]:
    """A cluster of ``nodes`` (1 or 2) of ``cpus`` CPUs each (declared, whatever the machine
    has). One node is named as this machine and is at 127.0.0.1; two are ``slurm-node0``
    and ``slurm-node1`` at addresses of a private /24 that exist only in their namespaces.
    Raises RuntimeError where it cannot start (call ``unavailable()`` first to skip)."""
    if nodes not in (1, 2):
        raise ValueError(f"slurm_cluster(nodes={nodes}): 1 or 2 nodes")
    root = Path(tempfile.mkdtemp(prefix="shardwise-slurm-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
    if nodes == 1:
        members = [Node(socket.gethostname().split(".")[0], f"swsl{tag}", "127.0.0.1")]
    else:
        members = [Node(f"slurm-node{i}", f"swsl{tag}n{i}", f"{subnet}.{i + 1}")
                   for i in range(nodes)]
    cluster = Cluster(root, members, env, spare=f"{subnet}.1")
    try:
        cluster.start(cpus)
        yield cluster
    finally:
        cluster.close()
