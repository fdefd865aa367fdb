"""All-reduce bandwidth sweep, comparison table, calibration: ``shardwise bench comm``.

    python benchmarks/comm_bench.py                     # N = 2, 4; 4 KiB .. 64 MiB; PNG
    python benchmarks/comm_bench.py --table             # seed table at N = 2, 4, 8
    python benchmarks/comm_bench.py --calibrate         # -> profiles/default.json
"""

import sys

from shardwise.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
