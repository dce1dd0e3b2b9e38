"""The scheduler in a process of its own, for the tests that kill it: it makes a manager (and
so the region, owned by this process) and holds it until stdin closes.

Prints ``{"ready": PID}`` once the region exists.

Usage: scheduler_process.py REGION_PATH ROWS WORKERS
"""

from __future__ import annotations

import json
import os
import sys

import kvtier.vllm as kv

PAGE = 4096


def main() -> None:
    region, rows, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    settings = kv.Settings(
        num_blocks=rows, region_path=region, workers=workers, block_bytes_per_worker=PAGE
    )
    manager = kv.KvtierOffloadingManager(settings, prefault_threads=2)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    sys.stdin.read()
    manager.shutdown()


if __name__ == "__main__":
    main()
