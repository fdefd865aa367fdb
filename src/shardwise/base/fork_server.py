"""Imported by ``launch``'s fork server only (``launch.PRELOAD``): the server ends with
``os._exit(0)`` instead of tearing down torch, which takes it 0.8 s on 2 cores, all the while
holding the launcher's standard output and error open (a caller reading the launcher's
output to its end, ``subprocess.run(capture_output=True)``, waited for it).

The server has nothing to flush or save: it forks ranks and waits. Imported anywhere else,
this module does nothing (it registers the exit only under ``multiprocessing.forkserver``'s
``main``, which imports the preloaded modules).
"""

from __future__ import annotations

import atexit
import os
import sys


def _in_fork_server() -> bool:
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(
                os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    atexit.register(os._exit, 0)
