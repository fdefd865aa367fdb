"""Every command's ``main``: ``shardwise train | bench | memory | plan | prepare | export |
generate | timeline`` (run as ``shardwise ...`` or ``python -m shardwise ...``)."""

from shardwise.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
