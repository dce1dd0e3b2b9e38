"""Stand-in for `vllm.platforms`: a CPU-only platform (no host-memory registration)."""


class _CpuPlatform:
    device_name = "cpu"

    def is_cuda_alike(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False


current_platform = _CpuPlatform()
