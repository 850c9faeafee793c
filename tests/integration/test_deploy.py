"""deploy/: every overlay renders with kubectl kustomize and validates strictly; a broken
manifest fails the same check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "deploy" / "check.sh"
VALIDATE = str(Path(sys.executable).parent / "kubernetes-validate")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def check(*overlays: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBERNETES_VALIDATE": VALIDATE}
    return subprocess.run(
        [str(CHECK), *map(str, overlays)], capture_output=True, text=True, env=env, timeout=120
    )


def render(overlay: str) -> str:
    """What ``kubectl kustomize deploy/overlays/OVERLAY`` renders."""
    return subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_every_overlay_renders_and_validates() -> None:
    result = check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dev: 33 objects rendered and valid" in result.stdout
    assert "prod: 34 objects rendered and valid" in result.stdout
    assert "replicas: 38 objects rendered and valid" in result.stdout
    assert "secured: 34 objects rendered and valid" in result.stdout


def test_rendered_manifests_have_grpc_probes_and_locked_down_pods() -> None:
    import yaml

    rendered = render("prod")
    assert rendered.count("service: mesh.v1.BrokerService") == 1
    assert rendered.count("service: mesh.v1.GatewayService") == 1
    assert rendered.count("service: mesh.v1.AgentService") == 5
    assert rendered.count("runAsNonRoot: true") == 7
    assert rendered.count("readOnlyRootFilesystem: true") == 7
    assert "kind: PodDisruptionBudget" in rendered
    assert rendered.count("kind: HorizontalPodAutoscaler") == 6
    assert rendered.count("kind: NetworkPolicy") == 8
    # The broker may call the agents' servers (push delivery), on their ports alone.
    policies = {
        o["metadata"]["name"]: o["spec"]
        for o in yaml.safe_load_all(rendered)
        if o and o["kind"] == "NetworkPolicy"
    }
    [push] = policies["agentmesh-broker-egress-to-agents"]["egress"]
    assert push["to"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/component": "agent"}
    assert push["ports"] == [{"port": 7000, "endPort": 7009, "protocol": "TCP"}]
    # Production queues are durable: SQLite on a persistent volume mounted by the broker.
    assert "value: sqlite:///var/lib/agentmesh/queues.db" in rendered
    assert "claimName: agentmesh-broker-queues" in rendered
    assert "mountPath: /var/lib/agentmesh" in rendered
    # and so are its events (RF-009 keeps hand-off logs for 30 days): on the same volume.
    assert "value: /var/lib/agentmesh/events/broker.jsonl" in rendered
    # Research runs in the cluster: the broker serves the subagents' tools and writes reports
    # to a volume of its own (its root file system is read-only), beside the queues.
    assert "- --tools\n        - agents.research:tool_host\n" in rendered
    assert "- agent\n        - agents.research:research_agents\n" in rendered
    assert "AGENTMESH_REPORTS_DIR: /var/lib/agentmesh-reports" in rendered
    assert "mountPath: /var/lib/agentmesh-reports" in rendered


def test_replicas_overlay_runs_several_brokers_on_redis() -> None:
    import yaml

    rendered = render("replicas")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(rendered)}
    broker = objects[("Deployment", "agentmesh-broker")]["spec"]
    assert broker["replicas"] == 3
    assert broker["strategy"]["type"] == "RollingUpdate"
    [env] = broker["template"]["spec"]["containers"][0]["env"]
    assert env == {"name": "AGENTMESH_STORE", "value": "redis://agentmesh-redis:6379/0"}
    assert ("StatefulSet", "agentmesh-redis") in objects
    assert ("Service", "agentmesh-redis") in objects
    assert ("PodDisruptionBudget", "agentmesh-broker") in objects
    # Redis takes connections from the brokers only, and the brokers may reach it.
    ingress = objects[("NetworkPolicy", "agentmesh-redis-ingress")]["spec"]["ingress"][0]
    assert ingress["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "agentmesh-broker"
    }
    assert ("NetworkPolicy", "agentmesh-broker-egress-to-redis") in objects


def test_secured_overlay_mounts_the_credentials_that_its_documented_command_writes(
    tmp_path: Path,
) -> None:
    """Every client of the secured overlay sends the token of its own key of Secret
    agentmesh-tokens, and the broker and gateway read the credentials file; each is a volume
    (a subPath mount would never see the Secret updated, so a token could not be rotated),
    readable by the pod's user. The command deploy/README.md gives writes a token file for
    every key mounted, and a principal for each agent group that names the agents its
    Deployment serves."""
    import shlex

    import yaml

    from mesh.cli import load_agents, main
    from mesh.core.auth import Authenticator

    rendered = render("secured")
    deployments = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in yaml.safe_load_all(rendered)
        if o and o["kind"] == "Deployment"
    }
    keys: dict[str, str] = {}
    for name, pod in deployments.items():
        [container] = pod["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert not any("subPath" in m for m in mounts.values()), name
        if name in ("agentmesh-broker", "agentmesh-gateway"):
            secret = volumes["credentials"]["secret"]
            assert secret["secretName"] == "agentmesh-credentials"
            path = mounts["credentials"]["mountPath"] + "/credentials.json"
            assert env["AGENTMESH_CREDENTIALS_FILE"] == path
        if name == "agentmesh-broker":
            continue
        secret = volumes["token"]["secret"]
        [item] = secret["items"]
        assert secret["secretName"] == "agentmesh-tokens"
        assert item["key"] == name.removeprefix("agentmesh-")
        assert env["AGENTMESH_TOKEN_FILE"] == f"{mounts['token']['mountPath']}/{item['path']}"
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        keys[item["key"]] = name
    assert len(keys) == 6  # the gateway and five agent groups

    readme = (ROOT / "deploy" / "README.md").read_text().replace("\\\n", " ")
    [command] = [line for line in readme.splitlines() if "--principal" in line]
    argv = shlex.split(command.replace("creds/", f"{tmp_path}/creds/"))
    assert main(argv[1:]) == 0
    tokens = tmp_path / "creds" / "tokens"
    auth = Authenticator.from_file(tmp_path / "creds" / "credentials.json")
    for key, name in keys.items():
        principal = auth.authenticate((tokens / key).read_text().strip())
        if key == "gateway":
            assert principal.admin
            continue
        args = deployments[name]["containers"][0]["args"]
        served = {a.agent_id for spec in args if ":" in spec for a in load_agents(spec)}
        assert served and principal.agents == served, (key, served, principal.agents)


def test_a_broken_manifest_fails_the_check(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    overlay = tmp_path / "deploy" / "overlays" / "broken"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "resources:\n  - ../../base\n"
        "patches:\n  - target: {kind: Deployment, name: agentmesh-broker}\n"
        "    patch: |\n      - op: replace\n        path: /spec/replicas\n        value: two\n"
    )
    result = check(overlay)
    assert result.returncode != 0
    assert "spec.replicas: 'two' is not of type 'integer'" in result.stdout + result.stderr
