"""deploy/kubernetes/ is checked against the bridge's own config model and wiring (no cluster runs here)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import yaml

from bridge.config import BridgeConfig, apply_env_overrides, parse_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"


def manifests() -> dict[str, dict[str, Any]]:
    docs = [doc for path in sorted(DEPLOY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return {doc["kind"]: doc for doc in docs}


def bridge_container(pod: dict[str, Any]) -> dict[str, Any]:
    [container] = [c for c in pod["containers"] if c["name"] == "rdq-bridge"]
    return container


def env_of(container: dict[str, Any], secret: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it (secret refs and the pod name resolved)."""
    env = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"], ref
            env[item["name"]] = secret["stringData"][ref["key"]]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = pod_name
        else:
            env[item["name"]] = str(item["value"])
    return env


def loaded() -> tuple[dict[str, dict[str, Any]], BridgeConfig]:
    kinds = manifests()
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    container = bridge_container(pod)
    config_file = PurePosixPath(container["args"][container["args"].index("--config") + 1])
    [mount] = [m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == config_file.parent]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
    tree = yaml.safe_load(kinds["ConfigMap"]["data"][config_file.name])
    env = env_of(container, kinds["Secret"], "orders-0")
    return kinds, parse_config(apply_env_overrides(tree, env), "deploy/kubernetes/configmap.yaml")


def test_the_configmap_with_the_pods_environment_is_a_valid_bridge_config() -> None:
    kinds, config = loaded()
    assert config.admin is not None and config.admin.auth != "none"
    assert config.admin.auth.key("ops") == kinds["Secret"]["stringData"]["admin-key"].encode()  # from the Secret
    assert config.kafka.consumer["group.instance.id"] == "orders-0"  # the pod's stable name
    assert bridge_container(kinds["StatefulSet"]["spec"]["template"]["spec"])["args"][0] == "run"  # rdq run


def test_probes_store_volume_and_grace_period_match_the_config() -> None:
    kinds, config = loaded()
    spec = kinds["StatefulSet"]["spec"]
    pod = spec["template"]["spec"]
    container = bridge_container(pod)
    assert config.telemetry.host == "0.0.0.0" and config.telemetry.port is not None
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": config.telemetry.port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": config.telemetry.port}
    [store] = [m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) ==
               PurePosixPath(str(config.store.path)).parent]
    assert store["name"] in {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    pre_stop_seconds = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    assert pod["terminationGracePeriodSeconds"] >= config.engine.grace_period + pre_stop_seconds + 5


def test_the_http_handler_calls_the_app_container_in_the_same_pod() -> None:
    kinds, config = loaded()
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    [app] = [c for c in pod["containers"] if c["name"] != "rdq-bridge"]
    app_ports = {p["containerPort"] for p in app["ports"]}
    for name, queue in config.queues.items():
        assert queue.http is not None, name
        url = urlparse(str(queue.http.url))
        assert url.hostname == "127.0.0.1" and url.port in app_ports, (name, url)


def test_the_example_secret_is_long_enough_to_be_a_key() -> None:
    assert len(manifests()["Secret"]["stringData"]["admin-key"].encode()) >= 32
