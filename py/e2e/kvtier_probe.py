"""A test spec over kvtier's own: ``spec_name = "ProbeOffloadingSpec"``,
``spec_module_path = "kvtier_probe"`` (this directory on ``PYTHONPATH``).

It changes no answer and no copy. It only writes what the end-to-end tests check, as JSON
lines under ``$KVTIER_PROBE_DIR``:

- ``blocks-PID.jsonl``: for every block a rank stores, the digest of its bytes in the
  engine's KV cache when the store was submitted, and for every block a rank loads, the
  digest of what the load left there, each under the block's key and its GPU block's index
  within the key's chunk (``{"op", "key", "index", "rank", "digest"}``);
- ``settings-PID.json``: the scheduler's kvtier settings (slots, bytes per block, policy);
- ``stats-PID.json``: the scheduler's ``stats()`` (hits, promotions, tiers), rewritten at
  every scheduler step and at shutdown.

The manager tags each spec it answers with the keys it is for; the spec travels to the
workers with vLLM's metadata, so the ranks know which key each GPU block holds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
from typing import Any

from kvtier.vllm import (
    KvtierOffloadingManager,
    KvtierOffloadingSpec,
    KvtierOffloadingWorker,
    _tensor_address,
)

DIR = os.environ.get("KVTIER_PROBE_DIR")


def _write(name: str, line: dict[str, Any]) -> None:
    if DIR is None:
        return
    with open(os.path.join(DIR, f"{name}-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


class ProbeManager(KvtierOffloadingManager):
    def __init__(self, settings: Any):
        super().__init__(settings)
        if DIR is not None:
            with open(os.path.join(DIR, f"settings-{os.getpid()}.json"), "w") as f:
                json.dump(dataclasses.asdict(settings), f, default=str)
        native_store, native_load = self.prepare_store, self.prepare_load
        native_end = self.on_schedule_end

        def prepare_store(keys: Any, req_context: Any) -> Any:
            out = native_store(keys, req_context)
            if out is not None:
                out.store_spec.probe_keys = [bytes(k).hex() for k in out.keys_to_store]
            return out

        def prepare_load(keys: Any, req_context: Any) -> Any:
            spec = native_load(keys, req_context)
            spec.probe_keys = [bytes(k).hex() for k in keys]
            return spec

        def on_schedule_end(context: Any = None) -> None:
            native_end(context)
            self._dump()

        self.prepare_store = prepare_store
        self.prepare_load = prepare_load
        self.on_schedule_end = on_schedule_end

    def _dump(self) -> None:
        if DIR is None:
            return
        path = os.path.join(DIR, f"stats-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.stats(), f, default=str)
        os.replace(path + ".tmp", path)

    def shutdown(self) -> None:
        self._dump()
        super().shutdown()


class ProbeWorker(KvtierOffloadingWorker):
    def __init__(self, kv_caches: Any, settings: Any):
        super().__init__(kv_caches, settings)
        # Per KV cache group: (address of block 0, bytes per block) of each of its tensors.
        self._pages = []
        for refs in kv_caches.group_data_refs:
            group = []
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx]
                address, _, _, _ = _tensor_address(t.tensor, int(t.page_size_bytes))
                group.append((address, int(t.page_size_bytes)))
            self._pages.append(group)
        self._loads: dict[int, list[tuple[str, int, int]]] = {}
        self._rank = settings.rank

    def _blocks(self, gpu_spec: Any, keys: list[str]) -> list[tuple[str, int, int, int]]:
        """(key, index in its chunk, group, GPU block) for each GPU block of the spec: a
        group's first block is block `block_indices[group]` of the request, so it lies that far
        modulo the chunk into the first key's chunk."""
        ids = [int(b) for b in gpu_spec.block_ids]
        sizes = getattr(gpu_spec, "group_sizes", None) or [len(ids)]
        starts = getattr(gpu_spec, "block_indices", None) or [0] * len(sizes)
        bpc = self.settings.blocks_per_chunk
        out, at = [], 0
        for group, (size, start) in enumerate(zip(sizes, starts)):
            for p in range(int(size)):
                g = int(start) % bpc + p
                out.append((keys[g // bpc], g % bpc, group, ids[at + p]))
            at += int(size)
        return out

    def _digest(self, group: int, block: int) -> str:
        h = hashlib.blake2b(digest_size=16)
        for address, page in self._pages[group]:
            h.update(ctypes.string_at(address + block * page, page))
        return h.hexdigest()

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        keys = getattr(dst_spec, "probe_keys", None)
        if keys is not None:
            for key, index, group, block in self._blocks(src_spec, keys):
                _write("blocks", {"op": "store", "key": key, "index": index, "rank": self._rank,
                                  "digest": self._digest(group, block)})
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, *args: Any) -> bool:
        keys = getattr(src_spec, "probe_keys", None)
        if keys is not None:
            self._loads[job_id] = [(k, i, g, b) for k, i, g, b in self._blocks(dst_spec, keys)]
        return super().submit_load(job_id, src_spec, dst_spec, *args)

    def get_finished(self) -> list[Any]:
        results = super().get_finished()
        for r in results:
            for key, index, group, block in self._loads.pop(r.job_id, ()):
                _write("blocks", {"op": "load", "key": key, "index": index, "rank": self._rank,
                                  "ok": bool(r.success), "digest": self._digest(group, block)})
        return results


class ProbeOffloadingSpec(KvtierOffloadingSpec):
    def get_manager(self) -> KvtierOffloadingManager:
        if self._manager is None:
            self._manager = ProbeManager(self.settings)
        return self._manager

    def get_worker(self, kv_caches: Any) -> KvtierOffloadingWorker:
        if self._worker is None:
            self._worker = ProbeWorker(kv_caches, self.settings)
        return self._worker
