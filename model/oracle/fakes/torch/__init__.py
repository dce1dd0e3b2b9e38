"""Stand-in for `torch` in the vLLM oracle.

The offloading managers only name torch in type annotations and in the shared-memory region
and host-registration code, which the oracle never runs (it hands the primary tier an
in-memory region instead). Anything that would really need torch raises.
"""


class Tensor:
    """Annotation-only tensor type."""


class dtype:
    """Annotation-only dtype type."""


int8 = dtype()
uint8 = dtype()


def _unavailable(*_args, **_kwargs):
    raise RuntimeError("the vLLM oracle runs without torch: this code path is not supported")


frombuffer = _unavailable
as_strided = _unavailable
empty = _unavailable
zeros = _unavailable
