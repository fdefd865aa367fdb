"""Alpha-beta-gamma cost model of every all-reduce algorithm, and the hardware profile.

Hockney's latency-bandwidth model as used by Thakur, Rabenseifner & Gropp 2005 (Sec. 2),
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 19(1)): sending a
message of m bytes costs alpha + m beta, reducing m bytes locally costs m gamma; an
algorithm is a sequence of steps and its time is the sum of its steps' times (Thakur et
al.'s steps and bytes, Sec. 4). Ours: a contention term for ranks sharing one host's CPUs,
a step in which k messages of m bytes move at once costs a(k) + m b(k), with
b(k) = max(beta_link, k beta_host), and k ranks reducing m bytes each m g(k), with
g(k) = max(gamma, k gamma_host); a(k) is alpha_1, alpha or alpha_swap by the step's kind.
The constants (``LinkParams``, seconds and seconds per byte) are per world size, measured
by ``shardwise bench comm --calibrate`` (``calibrate.py``). Every algorithm's formula in
seconds for X bytes on N ranks, and how the constants are measured: docs/comm.md,
"Algorithms and their costs" and "Cost model and profile". ``choose_all_reduce`` (the
``auto`` algorithm) returns the cheapest for N, X.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from shardwise.base.files import write_text

# Candidates of "auto": the ones worth picking; naive/sequential/parallel never win.
AUTO_CANDIDATES = ("native", "ring", "halving_doubling", "tree")


@dataclass(frozen=True)
class LinkParams:
    """Calibrated constants for one world size. Seconds, and seconds per byte."""

    alpha: float         # latency of a step in which several messages move
    beta_link: float     # per byte of one message alone on its link
    beta_host: float     # per byte of all bytes moving at once (the host's shared rate)
    gamma: float         # per byte reduced by one rank alone
    gamma_host: float    # per byte reduced, summed over ranks reducing at once
    native_alpha: float  # backend all_reduce: fixed cost
    native_beta: float   # backend all_reduce: per byte of the vector
    alpha_1: float = -1.0  # latency of a step with one message alone (-1: same as alpha)
    alpha_swap: float = -1.0  # latency of a pairwise-swap step (-1: same as alpha)
    shm_alpha: float = -1.0  # shared-memory all-reduce: seconds per round (-1: SHM_DEFAULT)
    shm_beta: float = -1.0   # shared-memory all-reduce: seconds per byte of the vector

    def shm(self) -> tuple[float, float]:
        """(shm_alpha, shm_beta), the uncalibrated defaults where this profile lacks them."""
        if self.shm_alpha >= 0 and self.shm_beta >= 0:
            return self.shm_alpha, self.shm_beta
        return SHM_DEFAULT

    @property
    def a_swap(self) -> float:
        """Seconds of latency of a pairwise-swap step: ``alpha_swap``, or ``alpha`` when
        uncalibrated (-1)."""
        return self.alpha if self.alpha_swap < 0 else self.alpha_swap

    def a(self, k: int) -> float:
        """Latency of a step in which ``k`` ports are busy."""
        return self.alpha_1 if k == 1 and self.alpha_1 >= 0 else self.alpha

    def b(self, k: int) -> float:
        """Seconds per byte of each of ``k`` equal messages moving at once on k links."""
        return max(self.beta_link, k * self.beta_host)

    def g(self, k: int) -> float:
        """Seconds per byte of each of ``k`` ranks reducing equal amounts in one step."""
        return max(self.gamma, k * self.gamma_host)


@dataclass
class Profile:
    """Hardware profile: ``LinkParams`` per world size, plus where they were measured."""

    name: str
    world_sizes: dict[int, LinkParams]
    meta: dict = field(default_factory=dict)

    def params(self, n: int) -> LinkParams:
        """Parameters measured at world size ``n``, else at the nearest one measured."""
        return self.world_sizes[self.measured_size(n)]

    def measured_size(self, n: int) -> int:
        """The world size whose parameters ``params(n)`` returns: ``n`` where it was
        measured, else the nearest one measured (ties: the larger)."""
        if n in self.world_sizes:
            return n
        return min(self.world_sizes, key=lambda k: (abs(k - n), -k))

    def to_json(self) -> dict:
        """The profile as JSON data: name, meta and the link parameters per world size."""
        return {"name": self.name, "meta": self.meta,
                "world_sizes": {str(k): asdict(v) for k, v in sorted(self.world_sizes.items())}}

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        """The profile ``to_json`` wrote. Raises ValueError when it holds no world size."""
        ws = {int(k): LinkParams(**v) for k, v in data["world_sizes"].items()}
        if not ws:
            raise ValueError("profile has no world_sizes")
        return cls(data.get("name", "unnamed"), ws, data.get("meta", {}))

    @property
    def backend(self) -> str:
        """The backend it was calibrated on (profiles written before this was recorded were
        all measured with gloo on the CPU)."""
        return self.meta.get("backend", "gloo")

    @property
    def device(self) -> str:
        """The device kind it was calibrated on (``device_kind``): "cpu" or "cuda:<name>"."""
        return self.meta.get("device", "cpu")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON to ``path`` (its folder created) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text(path, json.dumps(self.to_json(), indent=2) + "\n")


def load_profile(path: str | os.PathLike) -> Profile:
    """Read a profile JSON; ``ValueError`` naming the file if it is not one."""
    try:
        return Profile.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read comm profile {path}: {exc}; expected the constants of "
                         f"this cost model (rerun `shardwise bench comm --calibrate`)") from exc


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def tree_step_messages(n: int) -> list[int]:
    """c_k, k = 1..ceil(log2 n): messages in step k of a binomial reduce over ``n`` ranks
    (virtual rank v sends in step k iff v mod 2^k = 2^(k-1))."""
    return [sum(1 for v in range(n) if v % (2 << k) == (1 << k)) for k in range(_log2_ceil(n))]


def predict(algorithm: str, n: int, nbytes: float, prm: LinkParams) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` bytes on ``n`` ranks."""
    if algorithm == "rabenseifner":
        algorithm = "halving_doubling"
    x, a, b, g = float(nbytes), prm.a, prm.b, prm.g
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) * a(n) + 2 * (n - 1) / n * x * b(n) + (n - 1) / n * x * g(n)
    if algorithm == "halving_doubling":
        p = 1 << (n.bit_length() - 1)
        t = 2 * math.log2(p) * prm.a_swap + 2 * (p - 1) / p * x * b(p) + (p - 1) / p * x * g(p)
        return t if p == n else t + 2 * a(n - p) + 2 * x * b(n - p) + x * g(n - p)
    if algorithm == "tree":
        return sum(2 * a(c) + 2 * x * b(c) + x * g(c) for c in tree_step_messages(n))
    if algorithm == "naive":
        return 2 * a(n - 1) + 2 * x * b(n - 1) + (n - 1) * x * prm.gamma
    if algorithm == "sequential":
        return 2 * (n - 1) * (a(1) + x * b(1)) + (n - 1) * x * g(1)
    if algorithm == "parallel":
        return a(n * (n - 1)) + x * b(n * (n - 1)) + (n - 1) * x * g(n)
    if algorithm == "native":
        return prm.native_alpha + x * prm.native_beta
    if algorithm == "shm":
        sa, sb = prm.shm()
        from shardwise.comm.shm import rounds
        return rounds(int(x) // 4, 4, n) * sa + x * sb
    raise ValueError(f"no cost model for all-reduce algorithm {algorithm!r}")


# ---------------------------------------------------------------------------- the profile in use

REPO_PROFILE = Path(__file__).resolve().parents[3] / "profiles" / "default.json"

# Measured on the development machine (2 cores, gloo over loopback); used only when no
# profile file can be found, so that "auto" always has numbers to work with.
BUILTIN = Profile("builtin", {
    2: LinkParams(alpha=1e-4, beta_link=2.6e-10, beta_host=1.3e-10, gamma=9e-11,
                  gamma_host=5e-11, native_alpha=5e-4, native_beta=5.5e-10),
}, {"note": "fallback constants; run `shardwise bench comm --calibrate`",
    "backend": "gloo", "device": "cpu"})

# Shared-memory constants where a profile has none (measured with benchmarks/comm_bench.py on
# the 2-core development VM, N = 2; ``shardwise bench comm --calibrate`` measures them per N).
SHM_DEFAULT = (2e-5, 4e-10)

_active: Profile | None = None


def active_profile() -> Profile:
    """The profile ``auto`` uses: ``use_profile``'s, else $SHARDWISE_COMM_PROFILE, else
    ``profiles/default.json`` of the repository, else the built-in fallback."""
    global _active
    if _active is None:
        env = os.environ.get("SHARDWISE_COMM_PROFILE")
        if env:
            _active = load_profile(env)
        elif REPO_PROFILE.is_file():
            _active = _this_machine(load_profile(REPO_PROFILE))
        else:
            _active = BUILTIN
    return _active


def _this_machine(profile: Profile) -> Profile:
    """The repository's profile if it was measured on a machine like this one (same host name
    and core count), else the built-in fallback, with a warning: constants from another
    machine were 21-220% off (issue 15). An explicit profile (``use_profile``,
    $SHARDWISE_COMM_PROFILE) is used as given."""
    here, meta = host_meta(), profile.meta
    if meta.get("host") == here["host"] and meta.get("cores") == here["cores"]:
        return profile
    import warnings
    warnings.warn(f"comm profile {REPO_PROFILE} was measured on host {meta.get('host')!r} with "
                  f"{meta.get('cores')} cores, this is {here['host']!r} with {here['cores']}: "
                  "using the built-in constants; run `shardwise bench comm --calibrate` and "
                  "point $SHARDWISE_COMM_PROFILE at its output", RuntimeWarning, stacklevel=3)
    return BUILTIN


def use_profile(profile: Profile | str | os.PathLike | None) -> Profile:
    """Make ``profile`` (or the file at that path; None: the default lookup) the active one."""
    global _active
    _active = None if profile is None else (
        profile if isinstance(profile, Profile) else load_profile(profile))
    choose_all_reduce.cache_clear()
    return active_profile()


def predict_hierarchical(n: int, hosts: int, nbytes: float, profile: "Profile") -> float:
    """Hierarchical all-reduce on ``hosts`` hosts of n / hosts ranks: the shared-memory steps
    at the local size plus a ring across hosts on the host's slice (the ring's constants
    are those measured at world size ``hosts``: on one machine, loopback)."""
    local = n // hosts
    t = predict("shm", local, nbytes, profile.params(local)) if local > 1 else 0.0
    return t + predict("ring", hosts, nbytes / local, profile.params(hosts))


def device_kind(device) -> str:
    """What a profile records of the device it was calibrated on: "cpu", or "cuda:" and the
    GPU's name ("cuda:NVIDIA H100 80GB HBM3"), so a profile from one GPU model is not used
    for another. ``device``: a ``torch.device`` or its string."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return _cuda_kind(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _cuda_kind(index: int) -> str:
    import torch

    return f"cuda:{torch.cuda.get_device_name(index)}"


_refused: set[tuple[str, str, str]] = set()


def _refuse(profile: Profile, backend: str, device: str) -> None:
    """Say once per (profile, backend, device), in one line, that ``auto`` will not use a
    profile calibrated elsewhere."""
    key = (profile.name, backend, device)
    if key in _refused:
        return
    _refused.add(key)
    import warnings
    warnings.warn(f"comm profile {profile.name!r} was calibrated on {profile.backend}/"
                  f"{profile.device}, not {backend}/{device}: parallel.allreduce=auto uses the "
                  f"backend's own all-reduce (calibrate on this backend and device with "
                  "`shardwise bench comm --calibrate` to choose among ours)", RuntimeWarning,
                  stacklevel=4)


@lru_cache(maxsize=4096)
def choose_all_reduce(n: int, nbytes: int, extra: tuple[str, ...] = (), hosts: int = 1,
                      backend: str = "gloo", device: str = "cpu") -> str:
    """The ``auto`` choice: the candidate with the least predicted time (ties: first).
    ``extra``: "shm" (every rank on one host) and / or "hierarchical" (``hosts`` hosts).

    Only a profile calibrated on this ``backend`` and ``device`` kind (``device_kind``) is
    used to choose; with any other the answer is "native", the backend's own all-reduce,
    and a one-line warning says so once. So on CUDA tensors with NCCL, ``auto`` is NCCL's
    all-reduce (NVLink, many channels) unless a profile measured with NCCL on that GPU model
    says one of ours is faster; the CPU/gloo constants of the development machine are never
    used to route GPU gradients around NCCL."""
    profile = active_profile()
    if (profile.backend, profile.device) != (backend, device):
        _refuse(profile, backend, device)
        return "native"
    prm = profile.params(n)

    def t(a: str) -> float:
        if a == "hierarchical":
            return predict_hierarchical(n, hosts, nbytes, profile)
        return predict(a, n, nbytes, prm)

    return min(AUTO_CANDIDATES + tuple(extra), key=t)


def host_meta() -> dict:
    """Where a profile is measured: host name, machine, cores, Python (``calibrate`` adds
    the backend and the device kind)."""
    return {"host": platform.node(), "machine": platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version()}
