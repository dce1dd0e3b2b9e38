"""Stand-in for `vllm.logger`: standard-library loggers with vLLM's `*_once` helpers.

The oracle configures logging to stderr, so nothing reaches its JSON-lines stdout.
"""

import logging

_seen: set[tuple[str, str]] = set()


class _Logger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return msg, kwargs

    def _once(self, level: int, msg, *args, **kwargs) -> None:
        mark = (self.logger.name, str(msg))
        if mark in _seen:
            return
        _seen.add(mark)
        self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.WARNING, msg, *args, **kwargs)


def init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(name), {})
