"""Copy bandwidth of kvtier's CUDA engine against torch's ``copy_`` from pinned memory.

For each block size, one KV tensor of ``--total-mib`` on the GPU is cut into blocks of that
size, and every block is copied in one job, in each direction. With ``--order scattered``
(the default) the job lists the GPU blocks in a random order, as a long-running server's
block tables do, so no two neighbours in a job are neighbours on the GPU; with
``--order sequential`` they are listed in order, and kvtier merges runs of blocks adjacent
on both sides into one copy:

- ``kvtier``: kvtier's vLLM worker (``KvtierOffloadingWorker``) stores the blocks into its
  shared region (registered as pinned host memory) and loads them back, each job ordered
  after the current stream, all its copies in one ``cuMemcpyBatchAsync`` where the driver
  has it (CUDA 12.8 and later), else one ``cuMemcpyAsync`` per copy. Timed from ``submit_*`` until
  ``wait`` returns; the manager's bookkeeping (``prepare_*``, ``complete_*``) is outside.
- ``torch/block``: the same blocks in the same order, one ``copy_(non_blocking=True)`` per
  block between the GPU tensor and a pinned host tensor (``pin_memory=True``), then one
  synchronize.
- ``torch/whole``: the whole tensor in one ``copy_``: the link's ceiling for these bytes.

Each figure is the median of ``--reps`` timed runs after one untimed warm-up, in GB/s
(10^9 bytes per second). The blocks loaded back are checked byte for byte against those
stored.

Usage (a Python with torch on a CUDA machine, kvtier installed, and vLLM's offloading
classes importable: the vLLM oracle install, ``KVTIER_VLLM_DIR``)::

    python py/bench/cuda_copy.py [--sizes 16K,64K,256K,1M,4M] [--total-mib 256] [--reps 5]
        [--order scattered|sequential] [--region-dir /dev/shm] [--json out.json]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch  # before the oracle, whose stand-in for torch would otherwise be imported

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "model" / "oracle"))
import vllm_oracle  # noqa: E402

# `--device cpu` runs the same steps on host tensors (kvtier's copy thread instead of its CUDA
# engine, and no pinned memory): a check of this script on a machine without a GPU.
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


vllm_oracle.load_vllm()

import kvtier.vllm as kv  # noqa: E402
from vllm.v1.kv_offload import base  # noqa: E402


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class Kvtier:
    """kvtier's manager and worker over one GPU tensor of ``blocks`` blocks of ``size``."""

    def __init__(self, gpu: torch.Tensor, size: int, region_dir: str, order: list[int]):
        blocks = gpu.shape[0]
        self.order = order
        caches = base.CanonicalKVCaches(
            tensors=[base.CanonicalKVCacheTensor(tensor=gpu, page_size_bytes=size)],
            group_data_refs=[[base.CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=size)]],
        )
        self.dir = tempfile.mkdtemp(prefix="kvtier-cuda-bench-", dir=region_dir)
        settings = kv.Settings(
            num_blocks=blocks,
            region_path=os.path.join(self.dir, "region"),
            block_bytes_per_worker=size,
        )
        self.manager = kv.KvtierOffloadingManager(settings, prefault_threads=4)
        self.worker = kv.KvtierOffloadingWorker(caches, settings)
        self.ctx = base.ReqContext(req_id="bench")
        self.manager.on_new_request(self.ctx)
        self.blocks = blocks
        self.job = 0
        self.keys: list[bytes] = []

    def _run(self, submit) -> float:
        self.job += 1
        sync()
        t0 = time.perf_counter()
        assert submit(self.job)
        self.worker.wait({self.job})
        elapsed = time.perf_counter() - t0
        finished = self.worker.get_finished()
        assert [r.success for r in finished] == [True], finished
        return elapsed

    def store(self, generation: int) -> float:
        """Stores every block under fresh keys (the previous keys' slots are evicted)."""
        self.keys = [f"{generation}-{i}".encode() for i in range(self.blocks)]
        out = self.manager.prepare_store(self.keys, self.ctx)
        assert len(out.keys_to_store) == self.blocks, "the primary could not take every block"
        gpu = base.GPULoadStoreSpec(self.order, [self.blocks], [0])
        elapsed = self._run(lambda j: self.worker.submit_store(j, gpu, out.store_spec))
        self.manager.complete_store(self.keys, self.ctx)
        return elapsed

    def load(self) -> float:
        """Loads the last stored blocks back into the same GPU blocks."""
        src = self.manager.prepare_load(self.keys, self.ctx)
        gpu = base.GPULoadStoreSpec(self.order, [self.blocks], [0])
        elapsed = self._run(lambda j: self.worker.submit_load(j, src, gpu))
        self.manager.complete_load(self.keys, self.ctx)
        return elapsed

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()
        for f in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, f))
        os.rmdir(self.dir)


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def measure(size: int, total: int, reps: int, region_dir: str, scattered: bool) -> dict:
    blocks = max(1, total // size)
    order = list(range(blocks))
    if scattered:
        random.Random(size).shuffle(order)
    nbytes = blocks * size
    gpu = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, device=DEVICE)
    want = gpu.clone()
    host = torch.empty((blocks, size), dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    row: dict = {"block_bytes": size, "blocks": blocks, "bytes": nbytes}

    def per_block_d2h():
        for i, b in enumerate(order):
            host[i].copy_(gpu[b], non_blocking=True)

    def per_block_h2d():
        for i, b in enumerate(order):
            gpu[b].copy_(host[i], non_blocking=True)

    cases = {
        "torch_block_d2h": per_block_d2h,
        "torch_block_h2d": per_block_h2d,
        "torch_whole_d2h": lambda: host.copy_(gpu, non_blocking=True),
        "torch_whole_h2d": lambda: gpu.copy_(host, non_blocking=True),
    }
    for name, fn in cases.items():
        fn()  # warm-up
        row[name] = statistics.median(gbps(nbytes, timed(fn)) for _ in range(reps))
    assert torch.equal(gpu, want), "torch's round trip changed the blocks"

    engine = Kvtier(gpu, size, region_dir, order)
    try:
        engine.store(0)  # warm-up: first touch of the region's pages
        engine.load()
        stores, loads = [], []
        for rep in range(reps):
            stores.append(gbps(nbytes, engine.store(rep + 1)))
            gpu.zero_()
            loads.append(gbps(nbytes, engine.load()))
            sync()
            assert torch.equal(gpu, want), f"kvtier's round trip changed the blocks (rep {rep})"
        row["kvtier_d2h"] = statistics.median(stores)
        row["kvtier_h2d"] = statistics.median(loads)
    finally:
        engine.close()
    del gpu, want, host
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16K,64K,256K,1M,4M")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--region-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--order", choices=["scattered", "sequential"], default="scattered")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        device = "cpu (a check of the script: host tensors, no CUDA)"
    elif not torch.cuda.is_available():
        sys.exit("cuda_copy: torch sees no CUDA device")
    else:
        device = torch.cuda.get_device_name(0)
    print(
        f"device: {device}; torch {torch.__version__}; {args.total_mib} MiB per transfer; "
        f"blocks {args.order}"
    )
    header = (
        f"{'block':>7} {'blocks':>6} | {'kvtier':>7} {'torch/blk':>9} {'torch/all':>9} "
        f"| {'kvtier':>7} {'torch/blk':>9} {'torch/all':>9}   GB/s"
    )
    print(f"{'':>14} | {'GPU -> host (store)':^27} | {'host -> GPU (load)':^27}")
    print(header)
    rows = []
    for text in args.sizes.split(","):
        size = parse_size(text)
        row = measure(
            size, args.total_mib << 20, args.reps, args.region_dir, args.order == "scattered"
        )
        rows.append(row)
        print(
            f"{text:>7} {row['blocks']:>6} | {row['kvtier_d2h']:7.1f} {row['torch_block_d2h']:9.1f} "
            f"{row['torch_whole_d2h']:9.1f} | {row['kvtier_h2d']:7.1f} "
            f"{row['torch_block_h2d']:9.1f} {row['torch_whole_h2d']:9.1f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": device, "torch": torch.__version__, "order": args.order, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
