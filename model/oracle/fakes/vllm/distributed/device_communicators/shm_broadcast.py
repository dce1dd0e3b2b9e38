"""Stand-in for `vllm.distributed.device_communicators.shm_broadcast`.

Only the shared-memory region calls into it, and the oracle never builds one.
"""


def check_shm_free_space(*_args, **_kwargs):
    raise RuntimeError("the vLLM oracle does not create shared-memory regions")
