"""The shapes of vLLM 0.33's offloading interface, for use without vLLM.

When vLLM is installed, ``kvtier.vllm`` subclasses vLLM's own classes and answers with vLLM's
own types. Without it, these stand-ins have the same names, fields and members, so that the
manager and the worker handler work on their own (for tests and for other engines). They
hold no logic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


class LookupResult(enum.Enum):
    """The answer of ``lookup``."""

    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


class OffloadPolicy(enum.Enum):
    """Which of a request's blocks are offloaded."""

    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


class Medium(enum.Enum):
    """Where a tier keeps its blocks."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(enum.Enum):
    """Whether a tier is this node's own."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class CacheHitSource(str, enum.Enum):
    """Where a hit's KV came from."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


@dataclass
class ReqContext:
    """Per-request context: the request id and each key's end-token position."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _offload_key_positions: dict[bytes, int] = field(
        default_factory=dict, repr=False, init=False
    )

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type) -> Any:
        return self._state.get(cls)

    def set_offload_key_position(self, key: bytes, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self._offload_key_positions.get(key)


@dataclass
class RequestOffloadingContext:
    """How a request's blocks are offloaded."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


class ScheduleEndContext(NamedTuple):
    """What the step scheduled."""

    new_req_ids: Any
    preempted_req_ids: Any


class LoadStoreSpec:
    """Where a transfer's blocks are."""


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks by number."""

    def __init__(self, block_ids: list[int]):
        self.block_ids = np.array(block_ids, dtype=np.int32)

    def __repr__(self) -> str:
        return repr(self.block_ids)


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks, group by group."""

    def __init__(self, block_ids: list[int], group_sizes, block_indices):
        super().__init__(block_ids)
        assert sum(group_sizes) == len(block_ids)
        assert len(block_indices) == len(group_sizes)
        self.group_sizes = group_sizes
        self.block_indices = block_indices


@dataclass
class PrepareStoreOutput:
    """The answer of ``prepare_store``."""

    keys_to_store: list[bytes]
    store_spec: LoadStoreSpec
    evicted_keys: list[bytes]


@dataclass
class OffloadingEvent:
    """A change of which blocks a tier holds."""

    keys: list[bytes]
    medium: Medium
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False


@dataclass
class TransferResult:
    """How a worker's transfer ended."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


@dataclass
class CanonicalKVCacheTensor:
    """A KV cache tensor whose first dimension is the block."""

    tensor: Any
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """A group's use of one tensor."""

    tensor_idx: int
    page_size_bytes: int
    mapping: Any = None


@dataclass
class CanonicalKVCaches:
    """A worker's KV cache tensors and which groups read which."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


class OffloadingManager:
    """Base of scheduler-side managers (vLLM 0.33's shape: the caller reports a reset's
    flush through ``on_reset_flushed``)."""

    def on_reset_flushed(self) -> None:
        """Called once the jobs in flight at the last ``reset_cache`` have ended."""


class OffloadingWorker:
    """Base of worker-side transfer handlers."""


class OffloadingSpec:
    """Base of offloading specs: keeps the config and the settings every spec reads."""

    def __init__(self, config: Any):
        self.config = config
        self.extra_config = config.extra_config
        self.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
        self.tokens_per_hash = config.cache.tokens_per_hash
        self.blocks_per_chunk = config.cache.blocks_per_chunk
