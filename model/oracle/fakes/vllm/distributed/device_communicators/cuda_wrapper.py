"""Stand-in for `vllm.distributed.device_communicators.cuda_wrapper`: no CUDA runtime."""


class CudaRTLibrary:
    def __init__(self, *_args, **_kwargs):
        raise OSError("the vLLM oracle runs without a CUDA runtime")
