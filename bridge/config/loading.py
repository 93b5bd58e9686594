"""Reading a configuration (SPEC §2): the YAML file, `RDQ_` environment overrides, errors that name the file and
the field and never echo a value that may be a secret; which changes a reload can apply."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from bridge.config.models import ENV_PREFIX, POLICY_FIELDS, BridgeConfig, ConfigError, QueueConfig
from bridge.config.processes import as_child


def restart_only_changes(running: BridgeConfig, fresh: BridgeConfig) -> list[str]:
    """What differs between two configs outside the queues' retry policies (those apply live)."""
    changes = [section for section in ("kafka", "store", "admin", "telemetry", "engine", "workers")
               if getattr(running, section) != getattr(fresh, section)]
    added, removed = sorted(set(fresh.queues) - set(running.queues)), sorted(set(running.queues) - set(fresh.queues))
    changes += [f"queue {name!r} added" for name in added] + [f"queue {name!r} removed" for name in removed]
    for name in sorted(set(running.queues) & set(fresh.queues)):
        old, new = running.queues[name], fresh.queues[name]
        changes += [f"queues[{name!r}].{field}" for field in sorted(set(QueueConfig.model_fields) - POLICY_FIELDS)
                    if getattr(old, field) != getattr(new, field)]
    return changes


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "." in part or " " in part:
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


# Where a value may be a secret (keys, tokens, headers, librdkafka settings such as sasl.password): an error
# there names the field, never the value it got.
_SECRET_PARTS = frozenset({"keys", "tokens", "headers", "client", "consumer", "producer", "auth"})


def _got(item: Any, loc: tuple[int | str, ...]) -> str:
    """What the field held, when it cannot be a secret: a number or a boolean in a known, non-secret field. Never a
    string (a token typed under a misspelt or misplaced field is still a token), never an unknown field's value."""
    value = item.get("input")
    if item["type"] == "extra_forbidden" or any(part in _SECRET_PARTS for part in loc if isinstance(part, str)):
        return ""
    if isinstance(value, bool | int | float):
        return f" (got {value!r})"
    if isinstance(value, str):
        return f" (got a string of {len(value)} characters)"
    return ""


def describe_error(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for item in error.errors(include_input=True, include_context=False, include_url=False):
        loc = tuple(p for p in item["loc"] if not str(p).startswith(("function-after", "function-before")))
        lines.append(f"  {_format_loc(loc)}: {item['msg']}{_got(item, loc)}")
    return "\n".join(lines)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path):
        # Match existing keys case-insensitively: env names are upper case, YAML keys need not be.
        key = next((k for k in node if str(k).lower() == part.lower()), part.lower())
        if i == len(path) - 1:
            node[key] = value
            return
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child


def apply_env_overrides(tree: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """`RDQ_KAFKA__BOOTSTRAP_SERVERS=h:9092` sets kafka.bootstrap_servers; values parse as YAML scalars."""
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not path:
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        _set_path(tree, path, value)
    return tree


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What and where, without PyYAML's snippet of the offending line: that line may hold a key or a token."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"{error.problem or error.context or 'syntax error'} at line {mark.line + 1}, column {mark.column + 1}"
    return type(error).__name__


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> BridgeConfig:
    """Read, override and validate; raise ConfigError naming the file and field on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the configuration file: {e.strerror or e}") from e
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, not {type(tree).__name__}")
    environ = os.environ if environ is None else environ
    tree = apply_env_overrides(tree, environ)
    return as_child(parse_config(tree, str(path)), environ)  # a supervisor's child: its own store, id, ports


def parse_config(tree: dict[str, Any], source: str = "<config>") -> BridgeConfig:
    try:
        return BridgeConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(describe_error(e, source)) from e
