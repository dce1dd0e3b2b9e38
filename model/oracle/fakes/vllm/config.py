"""Stand-in for `vllm.config`: the names the offloading metrics module imports for typing."""


class VllmConfig:
    """Annotation-only engine configuration."""


class KVTransferConfig:
    """Annotation-only KV-transfer configuration."""
