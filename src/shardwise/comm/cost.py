"""Alpha-beta-gamma cost model of every all-reduce algorithm, and the hardware profile.

Hockney's latency-bandwidth model as used by Thakur, Rabenseifner & Gropp 2005 (Sec. 2):
sending a message of m bytes costs alpha + m beta; reducing m bytes locally costs m gamma.
On one machine the "network" is loopback TCP driven by the CPUs, so two betas are
calibrated: ``beta_x`` for the exchange step that ring and halving-doubling are made of
(every rank sends and receives at once) and ``beta_1`` for a lone one-way message (tree,
chain, parameter server), each with its own latency (alpha, alpha_1).
``shardwise bench comm --calibrate`` measures them for each world
size (ranks share the cores, so the values depend on it) and stores them as JSON.

Predicted seconds for X bytes on N ranks, p = 2^floor(log2 N), L = ceil(log2 N):

    ring              2(N-1) alpha + 2(N-1)/N X beta_x + (N-1)/N X gamma
    halving_doubling  2 log2(p) alpha + 2(p-1)/p X beta_x + (p-1)/p X gamma
                      (+ 2 alpha_1 + 2 X beta_1 + X gamma when N != p)
    tree              2 L alpha_1 + 2 L X beta_1 + L X gamma
    naive             2 alpha_1 + 2 (N-1) X beta_1 + (N-1) X gamma  (the root's link is shared)
    sequential        2 (N-1) (alpha_1 + X beta_1) + (N-1) X gamma
    parallel          alpha + (N-1) X beta_x + (N-1) X gamma
    native            alpha_native + X beta_native (fitted to the backend's own all-reduce)

``choose_all_reduce`` (the ``auto`` algorithm) returns the cheapest for N and X.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

# Candidates of "auto": the ones worth picking; naive/sequential/parallel never win.
AUTO_CANDIDATES = ("native", "ring", "halving_doubling", "tree")


@dataclass(frozen=True)
class LinkParams:
    """Calibrated constants for one world size. Seconds, and seconds per byte."""

    alpha: float           # latency of one exchange round (send and receive at once)
    beta_x: float          # per byte, each rank sending and receiving at the same time
    beta_1: float          # per byte, a one-way send with the receiver idle otherwise
    gamma: float           # per byte reduced (acc += other) on one rank
    native_alpha: float    # backend all_reduce: fixed cost
    native_beta: float     # backend all_reduce: per byte of the vector
    alpha_1: float = -1.0  # latency of a one-way round (-1: same as alpha)

    @property
    def a1(self) -> float:
        return self.alpha if self.alpha_1 < 0 else self.alpha_1


@dataclass
class Profile:
    """Hardware profile: ``LinkParams`` per world size, plus where they were measured."""

    name: str
    world_sizes: dict[int, LinkParams]
    meta: dict = field(default_factory=dict)

    def params(self, n: int) -> LinkParams:
        """Parameters measured at world size ``n``, else at the nearest one measured."""
        if n in self.world_sizes:
            return self.world_sizes[n]
        return self.world_sizes[min(self.world_sizes, key=lambda k: (abs(k - n), -k))]

    def to_json(self) -> dict:
        return {"name": self.name, "meta": self.meta,
                "world_sizes": {str(k): asdict(v) for k, v in sorted(self.world_sizes.items())}}

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        ws = {int(k): LinkParams(**v) for k, v in data["world_sizes"].items()}
        if not ws:
            raise ValueError("profile has no world_sizes")
        return cls(data.get("name", "unnamed"), ws, data.get("meta", {}))

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def load_profile(path: str | os.PathLike) -> Profile:
    """Read a profile JSON; ``ValueError`` naming the file if it is not one."""
    try:
        return Profile.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read comm profile {path}: {exc}") from exc


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def predict(algorithm: str, n: int, nbytes: float, prm: LinkParams) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` bytes on ``n`` ranks."""
    if algorithm == "rabenseifner":
        algorithm = "halving_doubling"
    a, bx, b1, g, x = prm.alpha, prm.beta_x, prm.beta_1, prm.gamma, float(nbytes)
    a1 = prm.a1
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * x * bx + (n - 1) / n * x * g
    if algorithm == "halving_doubling":
        p = 1 << (n.bit_length() - 1)
        t = 2 * math.log2(p) * a + 2 * (p - 1) / p * x * bx + (p - 1) / p * x * g
        return t if p == n else t + 2 * a1 + 2 * x * b1 + x * g
    if algorithm == "tree":
        L = _log2_ceil(n)
        return 2 * L * a1 + 2 * L * x * b1 + L * x * g
    if algorithm == "naive":
        return 2 * a1 + 2 * (n - 1) * x * b1 + (n - 1) * x * g
    if algorithm == "sequential":
        return 2 * (n - 1) * (a1 + x * b1) + (n - 1) * x * g
    if algorithm == "parallel":
        return a + (n - 1) * x * bx + (n - 1) * x * g
    if algorithm == "native":
        return prm.native_alpha + x * prm.native_beta
    raise ValueError(f"no cost model for all-reduce algorithm {algorithm!r}")


# ---------------------------------------------------------------------------- the profile in use

REPO_PROFILE = Path(__file__).resolve().parents[3] / "profiles" / "default.json"

# Measured on the development machine (2 cores, gloo over loopback); used only when no
# profile file can be found, so that "auto" always has numbers to work with.
BUILTIN = Profile("builtin", {
    2: LinkParams(alpha=6e-5, beta_x=4.5e-10, beta_1=2.6e-10, gamma=1e-10,
                  native_alpha=2e-4, native_beta=6.5e-10),
}, {"note": "fallback constants; run `shardwise bench comm --calibrate`"})

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
            _active = load_profile(REPO_PROFILE)
        else:
            _active = BUILTIN
    return _active


def use_profile(profile: Profile | str | os.PathLike | None) -> Profile:
    """Make ``profile`` (or the file at that path; None: the default lookup) the active one."""
    global _active
    _active = None if profile is None else (
        profile if isinstance(profile, Profile) else load_profile(profile))
    choose_all_reduce.cache_clear()
    return active_profile()


@lru_cache(maxsize=4096)
def choose_all_reduce(n: int, nbytes: int) -> str:
    """The ``auto`` choice: the candidate with the least predicted time (ties: first)."""
    prm = active_profile().params(n)
    return min(AUTO_CANDIDATES, key=lambda a: predict(a, n, nbytes, prm))


def host_meta() -> dict:
    return {"host": platform.node(), "machine": platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version()}
