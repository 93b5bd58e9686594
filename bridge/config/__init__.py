"""Configuration (SPEC §2): the models (models.py) and reading them (loading.py: YAML, `RDQ_` environment
overrides, errors naming the file and the field). A bad config raises `ConfigError`; the bridge never starts
half-configured."""

from bridge.config.loading import (
    apply_env_overrides,
    describe_error,
    load_config,
    parse_config,
    restart_only_changes,
)
from bridge.config.models import (
    MAX_DURATION,
    MIN_ADMIN_KEY_BYTES,
    POLICY_FIELDS,
    AdminAuth,
    AdminConfig,
    BackoffConfig,
    BreakerConfig,
    BridgeConfig,
    ConfigError,
    EngineConfig,
    ErrorsConfig,
    HeartbeatConfig,
    HttpHandlerConfig,
    KafkaConfig,
    QueueConfig,
    StoreConfig,
    TelemetryConfig,
    WorkersConfig,
    deep_merge,
    parse_duration,
)

__all__ = [
    "MAX_DURATION", "MIN_ADMIN_KEY_BYTES", "POLICY_FIELDS", "AdminAuth", "AdminConfig", "BackoffConfig",
    "BreakerConfig", "BridgeConfig", "ConfigError", "EngineConfig", "ErrorsConfig", "HeartbeatConfig",
    "HttpHandlerConfig", "KafkaConfig", "QueueConfig", "StoreConfig", "TelemetryConfig", "WorkersConfig",
    "apply_env_overrides", "deep_merge", "describe_error", "load_config", "parse_config", "parse_duration",
    "restart_only_changes",
]
