"""Stand-in for vLLM's KV cache specs: the offloading code imports these names for the
canonical page mapping of GPU workers, which the oracle does not run. Using one fails."""


class _Absent:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} is a stand-in in kvtier's vLLM oracle; the oracle does not "
            "build GPU KV cache layouts"
        )


class AttentionSpec(_Absent):
    pass


class KVCacheConfig(_Absent):
    pass


class KVCacheLayout(_Absent):
    pass


class KVCacheSpec(_Absent):
    pass


class MambaSpec(_Absent):
    pass


class MLAAttentionSpec(_Absent):
    pass


class UniformTypeKVCacheSpecs(_Absent):
    pass
