"""Every command's ``main``: ``shardwise train | bench | memory | plan | timeline``."""

from shardwise.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
