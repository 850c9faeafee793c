"""deploy/: every overlay renders with kubectl kustomize and validates strictly; a broken
manifest fails the same check."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
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
    assert "secured: 35 objects rendered and valid" in result.stdout


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


async def test_the_secured_overlays_tls_settings_serve_a_mesh_of_processes(tmp_path: Path) -> None:
    """The settings the secured overlay gives every pod (its ConfigMap, rendered), with the
    certificate deploy/README.md makes, run as the broker, a group of agents taking their
    messages by push and the gateway with its dashboard, in processes of their own: every
    hop speaks TLS under the mesh's one name (a plaintext call is refused), what the probes
    ask answers on each health port in plaintext, the broker pushes to the agents over TLS,
    a pattern runs through the gateway, and the dashboard reads the agents' health."""
    import json
    import shlex
    import urllib.request

    import yaml

    from gateway.client import GatewayClient
    from mesh import SecurityConfig
    from mesh.cli import main
    from tests.helpers.health import SERVING, health_of
    from tests.helpers.processes import BROKER_READY, free_port, start, stop

    objects = [o for o in yaml.safe_load_all(render("secured")) if o]
    [config] = [o["data"] for o in objects if o["metadata"]["name"] == "agentmesh-config"]
    probed = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
        for o in objects
        if o["kind"] == "Deployment"
    }
    assert probed["agentmesh-broker"]["grpc"]["port"] == int(config["AGENTMESH_HEALTH_PORT"])
    gateway_health = int(config["AGENTMESH_GATEWAY_HEALTH_PORT"])
    assert probed["agentmesh-gateway"]["grpc"]["port"] == gateway_health
    agent_health = int(config["AGENTMESH_AGENT_HEALTH_PORT"])
    assert probed["agentmesh-stock-experts"]["grpc"]["port"] == agent_health

    # The certificate, as deploy/README.md makes it, in the files the Secret's volume holds.
    readme = (ROOT / "deploy" / "README.md").read_text().replace("\\\n", " ")
    [command] = [line for line in readme.splitlines() if line.startswith("agentmesh certs ")]
    argv = shlex.split(command.split("#")[0].replace("tls/", f"{tmp_path}/tls/"))
    assert await asyncio.to_thread(main, argv[1:]) == 0
    secret = tmp_path / "secret"
    secret.mkdir()
    files = {"tls.crt": "server.pem", "tls.key": "server-key.pem", "ca.crt": "ca.pem"}
    for key, written in files.items():
        (secret / key).write_bytes((tmp_path / "tls" / written).read_bytes())
    env = {
        name: value.replace("/etc/agentmesh/tls", str(secret))
        for name, value in config.items()
        if name.startswith("AGENTMESH_TLS_")
    }
    # (Free ports in place of the fixed ones, the tests sharing this machine.)
    ports = {name: free_port() for name in ("broker", "gateway", "broker_health", "gateway_health")}
    agents_health = free_port()
    procs = []
    try:
        broker = await start(
            "broker", "--port", str(ports["broker"]), ready=BROKER_READY,
            env={**env, "AGENTMESH_HEALTH_PORT": str(ports["broker_health"])},
        )  # fmt: skip
        procs.append(broker)
        assert "(TLS; store memory://" in broker.output[-1], broker.output
        address = f"127.0.0.1:{ports['broker']}"
        # Reached at an address the certificate does not name, as an agent at its pod IP is.
        agents = await start(
            "agent", "agents.stocks:stock_experts", "--broker", address, "--delivery", "push",
            "--host", "0.0.0.0", "--port", str(free_port()), "--advertise-host", "127.0.0.2",
            ready=r"FundamentalAnalysisAgent serving on (\S+?)[,\s]",
            env={**env, "AGENTMESH_AGENT_HEALTH_PORT": str(agents_health)},
        )  # fmt: skip
        procs.append(agents)
        dashboard = free_port()
        gateway = await start(
            "gateway", "--broker", address, "--port", str(ports["gateway"]),
            "--dashboard-port", str(dashboard), ready=r"listening on (\S+?)[,\s]",
            env={**env, "AGENTMESH_GATEWAY_HEALTH_PORT": str(ports["gateway_health"])},
        )  # fmt: skip
        procs.append(gateway)
        # What the kubelet asks, in plaintext, on each health port.
        for at, service in (
            (ports["broker_health"], "mesh.v1.BrokerService"),
            (ports["gateway_health"], "mesh.v1.GatewayService"),
            (agents_health, "mesh.v1.AgentService"),
        ):
            assert await health_of(f"127.0.0.1:{at}", service) == SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await health_of(address)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE

        # A caller from outside: the CA, and the mesh's name (the port-forward's 127.0.0.1
        # would do as well: the certificate names it too).
        caller = SecurityConfig(tls_ca=str(secret / "ca.crt"), tls_server_name="agentmesh")
        async with GatewayClient(f"127.0.0.1:{ports['gateway']}", security=caller) as client:
            events = await client.collect(
                client.group_chat(
                    agent_ids=["IndustryExpertAgent", "TechnicalAnalysisAgent"],
                    query="Should I buy AAPL?",
                )
            )
        result = events[-1]["data"]
        assert events[-1]["kind"] == "RESULT" and result["status"] == "COMPLETED", result

        def agents_health_on_dashboard() -> dict[str, str]:
            url = f"http://127.0.0.1:{dashboard}/api/state"
            with urllib.request.urlopen(url, timeout=5) as reply:
                state = json.load(reply)
            return {a["agent_id"]: a["health"] for a in state.get("agents", [])}

        seen: dict[str, str] = {}
        for _ in range(100):  # (the dashboard samples the mesh every second or so)
            seen = await asyncio.to_thread(agents_health_on_dashboard)
            if len(seen) == 3:
                break
            await asyncio.sleep(0.1)
        assert seen == dict.fromkeys(
            ["FundamentalAnalysisAgent", "IndustryExpertAgent", "TechnicalAnalysisAgent"],
            "SERVING",
        )
    finally:
        for proc in reversed(procs):
            assert await stop(proc) == 0
