"""Hosts for real on one machine: network namespaces with their own addresses and names.

``with hosts(2) as net:`` makes hosts ``host0``, ``host1`` (... up to 4), each a network
namespace with an interface on one bridge (the bridge sits in a namespace of its own, so the
machine's own namespace gains no interface, address or route), an address in a private /24
that exists only inside these namespaces, ``/etc/netns/NAME/hosts`` naming every host, and a
hostname of its own (``unshare --uts``) for each command run there. On exit, also when the
test failed, every process in every namespace is killed (``ip netns pids``), the namespaces
and their ``/etc/netns`` files are removed. Names are unique per run (the pid and a random
tag) and cleanup is idempotent. Skips the test with the reason where ``ip netns`` or root is
missing (CI runs as root)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import pytest

NETNS_ETC = Path("/etc/netns")
IP_TIMEOUT_S = 10.0  # one `ip` call
KILL_WAIT_S = 10.0  # processes of a namespace gone after SIGKILL


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "network-namespace hosts need iproute2's ip and util-linux's unshare"
    probe = f"swprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S)
    entered = made.returncode == 0 and subprocess.run(
        ["ip", "netns", "exec", probe, "unshare", "--uts", "true"], capture_output=True,
        text=True, timeout=IP_TIMEOUT_S)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"ip netns add failed here: {made.stderr.strip()}"
    if entered.returncode != 0:
        return f"ip netns exec ... unshare --uts failed here: {entered.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    name: str  # hostname, as in every host's /etc/hosts: host0, host1, ...
    netns: str  # the namespace's name, unique per run
    addr: str  # its address in the private /24
    link: str  # its interface inside the namespace


@dataclass
class Hosts:
    """The hosts of one ``hosts()`` block; commands, kills and links go through it."""

    hosts: list[Host]
    bridge_ns: str
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run in ``host``'s namespace with its hostname (``unshare --uts``)."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', host.name, *argv]

    def popen(self, host: Host, argv: Sequence[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(host, argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, host: Host, argv: Sequence[str], timeout: float = 30.0,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), timeout=timeout, capture_output=True,
                              text=True, **kw)

    def pids(self, host: Host) -> list[int]:
        """Every process whose network namespace is ``host``'s."""
        out = _ip("netns", "pids", host.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process of ``host`` (a host lost whole); returns when none is left."""
        deadline = time.monotonic() + KILL_WAIT_S
        while (pids := self.pids(host)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for proc in self._procs:  # reap our own children among them (no zombies)
            if proc.poll() is None and proc.args[3] == host.netns:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=KILL_WAIT_S)
        if self.pids(host):
            raise RuntimeError(f"{host.name}: processes left after SIGKILL: {self.pids(host)}")

    def set_link(self, host: Host, up: bool) -> None:
        """Take ``host``'s interface down (a network partition) or up again."""
        _ip("-n", host.netns, "link", "set", host.link, "up" if up else "down")

    def close(self) -> None:
        """Kill every process, remove every namespace and file; safe to call twice."""
        for host in self.hosts:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.kill_host(host)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=KILL_WAIT_S)
        for ns in [h.netns for h in self.hosts] + [self.bridge_ns]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


@contextlib.contextmanager
def hosts(n: int = 2) -> Iterator[Hosts]:
    """``n`` (2-4) hosts on one bridge; skips the test where namespaces cannot be made."""
    if not 2 <= n <= 4:
        raise ValueError(f"hosts(n): 2 to 4 hosts, got {n}")
    if (why := unavailable()) is not None:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"  # unique per run, fits IFNAMSIZ
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"  # private /24
    net = Hosts([Host(f"host{i}", f"sw{tag}h{i}", f"{subnet}.{i + 1}", "eth0")
                 for i in range(n)], bridge_ns=f"sw{tag}br")
    try:
        _ip("netns", "add", net.bridge_ns)
        _ip("-n", net.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.bridge_ns, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in net.hosts)
        for i, h in enumerate(net.hosts):
            _ip("netns", "add", h.netns)
            (NETNS_ETC / h.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / h.netns / "hosts").write_text(hosts_file)
            _ip("link", "add", h.link, "netns", h.netns, "type", "veth",
                "peer", "name", f"p{i}", "netns", net.bridge_ns)
            _ip("-n", net.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.link)
            _ip("-n", h.netns, "link", "set", h.link, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield net
    finally:
        net.close()
