"""Parameter server: key-range sharded servers, workers that pull and push, and the
BSP / ASP / SSP consistency rules (Li et al., OSDI 2014; Ho et al., NIPS 2013).

``train_rank(cfg_dict)`` runs one rank of a job (``parallel.mode = "ps"``); the pieces are
``partition`` (key ranges), ``clock`` (the rules, pure), ``protocol`` (message headers),
``server``, ``worker`` and ``optim`` (the update a server applies).
"""

from shardwise.apps.param_server.clock import CONSISTENCIES, ClockTable
from shardwise.apps.param_server.partition import KeyRanges, partition
from shardwise.apps.param_server.training import train_rank

__all__ = ["CONSISTENCIES", "ClockTable", "KeyRanges", "partition", "train_rank"]
