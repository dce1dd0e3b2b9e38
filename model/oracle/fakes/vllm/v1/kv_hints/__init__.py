"""Stand-in for `vllm.v1.kv_hints`: the request context only carries an envelope around."""


class KvHintAction:
    """Annotation-only hint action."""


class KvHintsEnvelope:
    """Annotation-only hint envelope (the oracle never attaches hints)."""
