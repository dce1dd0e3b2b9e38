"""kvtier: a multi-tier KV-cache offloading engine whose core is a model-checked state machine.

``kvtier.vllm`` is the offloading backend for vLLM 0.33 (see docs/vllm.md). The exceptions
below are what kvtier raises: every one is a ``KvtierError``, and a bad setting is a
``ConfigError``, which is also a ``ValueError`` and names the setting.
"""

from kvtier._native import (
    ConfigError,
    KvtierError,
    RegionError,
    StateError,
    TierError,
    TransferError,
    __version__,
)

__all__ = [
    "ConfigError",
    "KvtierError",
    "RegionError",
    "StateError",
    "TierError",
    "TransferError",
    "__version__",
]
