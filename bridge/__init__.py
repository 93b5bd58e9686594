"""rdq-bridge: a Kafka sidecar that never loses failed work."""

from bridge.handler_api import HandlerContext, LeaseLost, Permanent, Retry
from bridge.registry import handler, register

__all__ = ["HandlerContext", "LeaseLost", "Permanent", "Retry", "handler", "register"]
__version__ = "0.1.0"
