"""Stand-in for `vllm.distributed.kv_transfer.kv_connector.v1.metrics`.

The real module pulls in prometheus_client and the connector factory. The offloading stats
class only needs the `KVConnectorStats` base: a dataclass holding one `data` dict.
"""

from dataclasses import dataclass, field
from typing import Any, TypeVar


@dataclass
class KVConnectorStats:
    """Base of connector stats: the serializable payload lives in `data`."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data


class KVConnectorPromMetrics:
    """Annotation-only Prometheus adapter base (the oracle exports no metrics)."""

    def __init__(self, *_args, **_kwargs):
        raise RuntimeError("the vLLM oracle does not export Prometheus metrics")


class PromMetric:
    """Annotation-only metric type."""


PromMetricT = TypeVar("PromMetricT")
