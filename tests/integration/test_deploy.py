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
    assert "prod: 35 objects rendered and valid" in result.stdout
    assert "replicas: 38 objects rendered and valid" in result.stdout
    assert "secured: 36 objects rendered and valid" in result.stdout


def test_rendered_manifests_have_grpc_probes_and_locked_down_pods() -> None:
    import yaml

    rendered = render("prod")
    assert rendered.count("service: mesh.v1.BrokerService") == 1
    assert rendered.count("service: mesh.v1.GatewayService") == 1
    # (a pod of agents is ready while every one of them takes its messages)
    assert rendered.count("service: agentmesh.agents\n") == 5
    assert rendered.count("runAsNonRoot: true") == 7
    assert rendered.count("readOnlyRootFilesystem: true") == 7
    assert "kind: PodDisruptionBudget" in rendered
    assert rendered.count("kind: HorizontalPodAutoscaler") == 6
    assert rendered.count("kind: NetworkPolicy") == 9
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
    # Traces go to an OpenTelemetry Collector (deploy/components/tracing), a request in ten
    # sampled where it starts: every role reads agentmesh-config, and may reach the collector.
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(rendered) if o}
    config = objects[("ConfigMap", "agentmesh-config")]["data"]
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.monitoring.svc:4317"
    assert (config["OTEL_TRACES_SAMPLER"], config["OTEL_TRACES_SAMPLER_ARG"]) == (
        "parentbased_traceidratio",
        "0.1",
    )
    deployments = [o for (kind, _), o in objects.items() if kind == "Deployment"]
    assert len(deployments) == 7
    for deployment in deployments:
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert {"configMapRef": {"name": "agentmesh-config"}} in container["envFrom"]
    collector = policies["agentmesh-egress-to-collector"]
    assert collector["podSelector"] == {} and collector["policyTypes"] == ["Egress"]
    to_collector, dns = collector["egress"]
    assert to_collector["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    assert to_collector["ports"] == [{"port": 4317, "protocol": "TCP"}]
    assert {p["port"] for p in dns["ports"]} == {53}


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
    """Every client of the secured overlay (the broker too: it pushes) sends the token of its
    own key of Secret agentmesh-tokens, and every server (each agent's too) reads the
    credentials file; each is a volume (a subPath mount would never see the Secret updated,
    so a token could not be rotated), readable by the pod's user. The command
    deploy/README.md gives writes a token file for every key mounted, and a principal for
    each agent group that names the agents its Deployment serves."""
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
        secret = volumes["credentials"]["secret"]
        assert secret["secretName"] == "agentmesh-credentials"
        path = mounts["credentials"]["mountPath"] + "/credentials.json"
        assert env["AGENTMESH_CREDENTIALS_FILE"] == path
        secret = volumes["token"]["secret"]
        [item] = secret["items"]
        assert secret["secretName"] == "agentmesh-tokens"
        assert item["key"] == name.removeprefix("agentmesh-")
        assert env["AGENTMESH_TOKEN_FILE"] == f"{mounts['token']['mountPath']}/{item['path']}"
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        keys[item["key"]] = name
    assert len(keys) == 7  # the broker, the gateway and five agent groups

    readme = (ROOT / "deploy" / "README.md").read_text().replace("\\\n", " ")
    [command] = [line for line in readme.splitlines() if "--principal" in line]
    argv = shlex.split(command.replace("creds/", f"{tmp_path}/creds/"))
    assert main(argv[1:]) == 0
    tokens = tmp_path / "creds" / "tokens"
    auth = Authenticator.from_file(tmp_path / "creds" / "credentials.json")
    for key, name in keys.items():
        principal = auth.authenticate((tokens / key).read_text().strip())
        if key in ("gateway", "broker"):
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


async def test_the_secured_overlay_serves_a_mesh_of_processes_with_its_own_settings(
    tmp_path: Path,
) -> None:
    """The settings the secured overlay gives each pod (its ConfigMap and its Deployments'
    variables, rendered), with the certificate and the credentials deploy/README.md makes, run
    as the broker, a group of agents taking their messages by push and the gateway with its
    dashboard, in processes of their own: every hop speaks TLS under the mesh's one name (a
    plaintext call is refused), every call needs a token (one without is refused), what the
    probes ask answers on each health port in plaintext, the broker pushes to the agents
    with its own token, a pattern runs through the gateway with the operator's, and the
    dashboard reads the agents' health."""
    import json
    import shlex
    import ssl
    import urllib.request

    import yaml

    from gateway.client import GatewayClient
    from mesh import MeshError, SecurityConfig
    from mesh.cli import main
    from tests.helpers.health import SERVING, health_of
    from tests.helpers.processes import (
        BROKER_READY,
        free_port,
        free_ports_in_a_row,
        start,
        stop,
    )

    objects = [o for o in yaml.safe_load_all(render("secured")) if o]
    [config] = [o["data"] for o in objects if o["metadata"]["name"] == "agentmesh-config"]
    pods = {
        o["metadata"]["name"].removeprefix("agentmesh-"): o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] == "Deployment"
    }
    health_ports = {
        "broker": config["AGENTMESH_HEALTH_PORT"],
        "gateway": config["AGENTMESH_GATEWAY_HEALTH_PORT"],
        "stock-experts": config["AGENTMESH_AGENT_HEALTH_PORT"],
    }
    for name, port in health_ports.items():
        [container] = pods[name]["containers"]
        assert container["readinessProbe"]["grpc"]["port"] == int(port), name
        assert container["livenessProbe"]["grpc"]["port"] == int(port), name

    # The certificate and the credentials, as deploy/README.md makes them, in the files the
    # Secrets' volumes hold.
    readme = (ROOT / "deploy" / "README.md").read_text().replace("\\\n", " ")
    [certs] = [line for line in readme.splitlines() if line.startswith("agentmesh certs ")]
    [creds] = [line for line in readme.splitlines() if "--principal" in line]
    for command in (certs, creds):
        argv = shlex.split(command.split("#")[0].replace(" tls/", f" {tmp_path}/tls/"))
        argv = [a.replace("creds/", f"{tmp_path}/creds/") for a in argv]
        assert await asyncio.to_thread(main, argv[1:]) == 0
    secret = tmp_path / "secret"
    secret.mkdir()
    files = {"tls.crt": "server.pem", "tls.key": "server-key.pem", "ca.crt": "ca.pem"}
    for key, written in files.items():
        (secret / key).write_bytes((tmp_path / "tls" / written).read_bytes())

    def env_of(name: str, health_variable: str) -> dict[str, str]:
        """The variables of a pod of Deployment agentmesh-NAME, its files where this test
        keeps them, and a free health port in place of the fixed one."""
        [container] = pods[name]["containers"]
        variables = {k: v for k, v in config.items() if k.startswith("AGENTMESH_TLS_")}
        variables.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
        [token] = [
            v["secret"]["items"][0]["key"] for v in pods[name]["volumes"] if v["name"] == "token"
        ]
        places = {
            "/etc/agentmesh/tls": str(secret),
            "/etc/agentmesh/credentials": str(tmp_path / "creds"),
            "/etc/agentmesh/token/token": str(tmp_path / "creds" / "tokens" / token),
        }
        for variable in variables:
            for inside, here in places.items():
                variables[variable] = variables[variable].replace(inside, here)
        variables.pop("AGENTMESH_STORE", None)  # (prod's SQLite volume: the memory store here)
        variables.pop("AGENTMESH_EVENT_LOG", None)
        variables[health_variable] = str(free_port())
        return variables

    broker_env = env_of("broker", "AGENTMESH_HEALTH_PORT")
    agents_env = env_of("stock-experts", "AGENTMESH_AGENT_HEALTH_PORT")
    agents_env["AGENTMESH_AGENT_HEALTH_PORT"] = str(free_ports_in_a_row(3))  # (counting up)
    gateway_env = env_of("gateway", "AGENTMESH_GATEWAY_HEALTH_PORT")
    assert {"AGENTMESH_CREDENTIALS_FILE", "AGENTMESH_TOKEN_FILE"} <= set(broker_env)
    assert {"AGENTMESH_CREDENTIALS_FILE", "AGENTMESH_TOKEN_FILE"} <= set(agents_env)
    procs = []
    try:
        port = free_port()
        broker = await start("broker", "--port", str(port), ready=BROKER_READY, env=broker_env)
        procs.append(broker)
        assert "(TLS, credentials required; store memory://" in broker.output[-1], broker.output
        address = f"127.0.0.1:{port}"
        # Reached at an address the certificate does not name, as an agent at its pod IP is.
        agents = await start(
            "agent", "agents.stocks:stock_experts", "--broker", address, "--delivery", "push",
            "--host", "0.0.0.0", "--port", str(free_ports_in_a_row(3)),
            "--advertise-host", "127.0.0.2",
            ready=r"FundamentalAnalysisAgent serving on (\S+?)[,\s]", env=agents_env,
        )  # fmt: skip
        procs.append(agents)
        assert "(TLS, credentials required)" in agents.output[-1], agents.output
        dashboard = free_port()
        gateway_port = free_port()
        gateway = await start(
            "gateway", "--broker", address, "--port", str(gateway_port),
            "--dashboard-port", str(dashboard), ready=r"listening on (\S+?)[,\s]",
            env=gateway_env,
        )  # fmt: skip
        procs.append(gateway)
        # What the kubelet asks (each readiness probe's service), in plaintext, on each
        # health port.
        for name, variables in (
            ("broker", broker_env["AGENTMESH_HEALTH_PORT"]),
            ("gateway", gateway_env["AGENTMESH_GATEWAY_HEALTH_PORT"]),
            ("stock-experts", agents_env["AGENTMESH_AGENT_HEALTH_PORT"]),
        ):
            [container] = pods[name]["containers"]
            service = container["readinessProbe"]["grpc"]["service"]
            assert await health_of(f"127.0.0.1:{variables}", service) == SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await health_of(address)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE

        # A caller from outside: the CA, the mesh's name (a port-forward's 127.0.0.1 would do
        # as well: the certificate names it too), and the operator's token.
        ca = str(secret / "ca.crt")
        operator = (tmp_path / "creds" / "tokens" / "operator").read_text().strip()
        caller = SecurityConfig(tls_ca=ca, tls_server_name="agentmesh", token=operator)
        stranger = caller.evolve(token="")
        chat = {"agent_ids": ["IndustryExpertAgent", "TechnicalAnalysisAgent"], "query": "AAPL?"}
        async with GatewayClient(f"127.0.0.1:{gateway_port}", security=stranger) as client:
            with pytest.raises(MeshError) as refused:
                await client.collect(client.group_chat(**chat))
            assert refused.value.code == "UNAUTHENTICATED"
        async with GatewayClient(f"127.0.0.1:{gateway_port}", security=caller) as client:
            events = await client.collect(client.group_chat(**chat))
        result = events[-1]["data"]
        assert events[-1]["kind"] == "RESULT" and result["status"] == "COMPLETED", result

        def agents_health_on_dashboard() -> dict[str, str]:
            # (over HTTPS: the dashboard serves the gateway's certificate)
            url = f"https://127.0.0.1:{dashboard}/api/state"
            trusting = ssl.create_default_context(cafile=ca)
            with urllib.request.urlopen(url, timeout=5, context=trusting) as reply:
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
