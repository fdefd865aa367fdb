"""Per-rank byte accounting of every collective call.

Off by default, and then it costs one ``is None`` test per round. When on (``enable()`` or
``with recording():``), each call on each rank leaves one ``CallRecord``: bytes and messages
this rank sent and received, the rounds it took part in and the last round it saw. Bytes are
tensor payload bytes (``numel * element_size``) as handed to ``torch.distributed``'s
``isend``/``irecv``; the transport's own headers are not counted. For ``native`` calls the
backend moves the bytes itself, so they are recorded as unknown (``None``).

A "step" is a round of the algorithm's schedule (see ``primitives.Call``): the number of
steps of a call is the largest ``last_step`` over the ranks of the group.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch


@dataclass
class CallRecord:
    """What one collective call moved on one rank. Bytes are payload bytes."""

    collective: str
    algorithm: str
    group_size: int
    group_rank: int
    rank: int                      # global rank
    nbytes: int                    # X: the size of the call's message, in bytes
    dtype: str
    bytes_sent: int | None = 0
    bytes_recv: int | None = 0
    msgs_sent: int | None = 0
    msgs_recv: int | None = 0
    steps: int | None = 0          # rounds in which this rank sent or received
    last_step: int | None = 0      # the last round this rank took part in
    peers: list[int] = field(default_factory=list)  # global ranks talked to (sorted)

    def __post_init__(self) -> None:
        self._seen: set[int] = set()  # steps already counted (not a field: not in as_dict)

    def add_message(self, step: int, nbytes: int, sent: bool) -> None:
        """One non-empty message of round ``step``; rounds may interleave (pipelined ring)."""
        if sent:
            self.bytes_sent += nbytes
            self.msgs_sent += 1
        else:
            self.bytes_recv += nbytes
            self.msgs_recv += 1
        if step not in self._seen:
            self._seen.add(step)
            self.steps += 1
            self.last_step = max(self.last_step, step)

    def as_dict(self) -> dict:
        """This record as a plain dict (the fields by name), for JSON."""
        return asdict(self)


class CallLog:
    """The records of this process, in call order."""

    def __init__(self) -> None:
        self.enabled = False
        self.records: list[CallRecord] = []

    def append(self, record: CallRecord) -> None:
        """Add ``record`` to the log (safe from the comm thread: list.append is atomic)."""
        self.records.append(record)  # list.append is atomic: safe from the comm thread


log = CallLog()


def open_record(collective: str, algorithm: str, group_size: int, group_rank: int, rank: int,
                nbytes: int, dtype: torch.dtype | None) -> CallRecord:
    """A new record of one collective call: its algorithm, the group's size and this rank's place in
    it, ``nbytes`` of payload and the dtype's short name (``-`` for none)."""
    return CallRecord(collective, algorithm, group_size, group_rank, rank, nbytes,
                      str(dtype).replace("torch.", "") if dtype is not None else "-")


def native_record(collective: str, group_size: int, group_rank: int, rank: int, nbytes: int,
                  dtype: torch.dtype | None) -> None:
    """Record a backend-native call: counted, bytes unknown."""
    if log.enabled:
        r = open_record(collective, "native", group_size, group_rank, rank, nbytes, dtype)
        r.bytes_sent = r.bytes_recv = r.msgs_sent = r.msgs_recv = r.steps = r.last_step = None
        log.append(r)


def enable(reset: bool = True) -> None:
    """Start recording on this rank (and forget old records unless ``reset=False``)."""
    if reset:
        log.records.clear()
    log.enabled = True


def disable() -> None:
    """Stop recording calls (the records kept so far stay)."""
    log.enabled = False


def reset() -> None:
    """Drop every record kept so far (recording stays as it is)."""
    log.records.clear()


class recording:
    """``with recording() as rec:`` records the calls made inside; ``rec.records`` after."""

    def __enter__(self) -> CallLog:
        self._was = log.enabled
        self._start = len(log.records)
        log.enabled = True
        self.records: list[CallRecord] = []
        return self  # type: ignore[return-value]

    def __exit__(self, *exc) -> None:
        from shardwise.comm import async_
        async_.drain()  # let queued async calls finish so their records are complete
        self.records = log.records[self._start:]
        log.enabled = self._was


def table(records: Iterable[CallRecord] | None = None) -> list[dict]:
    """Records (default: all of this rank's) as a list of plain dicts, one per call."""
    return [r.as_dict() for r in (log.records if records is None else records)]


COLUMNS = ("collective", "algorithm", "rank", "group_size", "nbytes", "bytes_sent",
           "bytes_recv", "msgs_sent", "msgs_recv", "steps", "last_step")


def format_table(rows: Iterable[dict], columns: Iterable[str] = COLUMNS) -> str:
    """Fixed-width text table of record dicts (from any number of ranks)."""
    cols = list(columns)
    body = [["-" if row.get(c) is None else str(row.get(c)) for c in cols] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in body]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)
