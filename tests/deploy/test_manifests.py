"""deploy/k8s, deploy/compose.yaml and deploy/prometheus: valid, and consistent with the server.

Schemas: kubernetes-validate (Kubernetes' OpenAPI schemas, strict) and check-jsonschema's
bundled compose-spec. Each validator is also shown a broken copy, so a validator that
passes everything fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from spyre_serve.deploy.fleet import ROUTER_FLAGS
from spyre_serve.server.launch.cli import Settings
from tests.deploy.dockerfile import parse
from tests.deploy.procs import REPO, VENV_BIN

K8S = REPO / "deploy" / "k8s"
COMPOSE = REPO / "deploy" / "compose.yaml"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
K8S_FILES = sorted(K8S.glob("*.yaml"))
ROUTER_FILES = sorted((K8S / "router").glob("*.yaml"))
POOL = K8S / "inference-extension" / "inferencepool.yaml"
IMAGE_PORT = int(parse(REPO / "Dockerfile")[-1].args("EXPOSE")[0])


def _tool(name: str) -> str:
    return shutil.which(name) or str(VENV_BIN / name)


def _k8s_validate(path, version: str) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("kubernetes-validate"), "--strict", "-k", version, str(path)],
                          capture_output=True, text=True, timeout=120)


def _k8s(kind: str) -> dict:
    docs = [d for f in K8S_FILES for d in yaml.safe_load_all(f.read_text()) if d]
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _container() -> dict:
    (c,) = _k8s("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def _drain_timeout() -> float:
    env = {e["name"]: e.get("value") for e in _container()["env"]}
    return float(env.get("SPYRE_SERVE_DRAIN_TIMEOUT") or Settings().drain_timeout)


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
@pytest.mark.parametrize("path", K8S_FILES + ROUTER_FILES, ids=lambda p: p.name)
def test_k8s_manifest_is_valid(path, version):
    r = _k8s_validate(path, version)
    assert r.returncode == 0, r.stdout + r.stderr


def test_k8s_validator_rejects_an_unknown_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((K8S / "deployment.yaml").read_text().replace(
        "terminationGracePeriodSeconds", "terminationGracePeriod"))
    assert _k8s_validate(bad, "1.37.0").returncode != 0


def test_probes_ask_health_on_the_served_port():
    c = _container()
    (port,) = c["ports"]
    assert port["containerPort"] == IMAGE_PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in (port["name"], IMAGE_PORT), probe


def test_grace_period_covers_prestop_and_the_drain():
    spec = _k8s("Deployment")["spec"]["template"]["spec"]
    cmd = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > float(cmd[1]) + _drain_timeout()


def test_liveness_outlasts_the_drain():
    # /health answers 503 while the server drains; liveness must not kill it meanwhile
    live = _container()["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > _drain_timeout()


def test_pod_runs_as_the_image_user():
    user = parse(REPO / "Dockerfile")[-1].args("USER")[0]
    sc = _k8s("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert f"{sc['runAsUser']}:{sc['runAsGroup']}" == user


def test_service_and_pdb_select_the_deployment_pods():
    labels = _k8s("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _k8s("Service")["spec"]
    assert service["selector"].items() <= labels.items()
    assert service["ports"][0]["targetPort"] in ("http", IMAGE_PORT)
    assert _k8s("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_hpa_scales_on_the_metric_the_adapter_rule_serves():
    hpa = _k8s("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == _k8s("Deployment")["metadata"]["name"]
    (metric,) = hpa["metrics"]
    rules = yaml.safe_load(_k8s("ConfigMap")["data"]["config.yaml"])["rules"]
    (rule,) = [r for r in rules if r["name"]["as"] == metric["pods"]["metric"]["name"]]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert re.fullmatch(rule["name"]["matches"], "vllm:num_requests_waiting")


def _compose_validate(path) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=120)


def test_compose_file_is_valid():
    r = _compose_validate(COMPOSE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_validator_rejects_an_unknown_key(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text().replace("stop_grace_period", "stop_grace_perod"))
    assert _compose_validate(bad).returncode != 0


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_router_is_the_front_on_loopback_with_the_fleets_flags():
    router = _services()["router"]
    assert router["ports"] == [f"127.0.0.1:{IMAGE_PORT}:8000"] and "nginx" not in _services()
    (command,) = router["command"]
    assert " ".join(ROUTER_FLAGS) in command
    # one worker URL per replica of the service, by the container names compose gives them
    assert f"http://spyre-serve-spyre-$$i:{IMAGE_PORT}" in command and "${SPYRE_REPLICAS:-2}" in command
    assert yaml.safe_load(COMPOSE.read_text())["name"] == "spyre-serve"
    assert router["read_only"] is True and router["cap_drop"] == ["ALL"]
    assert router["security_opt"] == ["no-new-privileges:true"]


def test_compose_publishes_only_on_loopback_and_drops_privileges():
    for name, service in _services().items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
        assert service["cap_drop"] == ["ALL"] and service["security_opt"] == ["no-new-privileges:true"], name


def test_the_router_image_installs_the_pinned_router():
    docker = (REPO / "deploy" / "router" / "Dockerfile").read_text()
    assert "requirements.txt" in docker and "USER 10002" in docker
    pins = [line for line in (REPO / "deploy" / "router" / "requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    (pin,) = pins
    version = pin.split("==")[1]
    assert _services()["router"]["image"] == f"spyre-router:{version}"
    (router,) = [d for d in _router_docs() if d["kind"] == "Deployment"]
    assert router["spec"]["template"]["spec"]["containers"][0]["image"] == f"spyre-router:{version}"


def test_compose_stop_grace_period_covers_the_drain():
    grace = _services()["spyre"]["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > _drain_timeout()


def test_prometheus_scrapes_every_replica_of_the_service():
    (job,) = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["spyre"] and sd["type"] == "A" and sd["port"] == IMAGE_PORT
    assert job.get("metrics_path", "/metrics") == "/metrics"
    mount = _services()["prometheus"]["volumes"][0].split(":")
    assert (COMPOSE.parent / mount[0]).resolve() == PROMETHEUS.resolve()
    assert mount[1] == "/etc/prometheus/prometheus.yml"


def test_the_pod_is_hardened_and_its_network_policy_covers_it():
    spec = _k8s("Deployment")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    c = _container()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/tmp" in mounts                                   # the one writable place
    policy = _k8s("NetworkPolicy")["spec"]
    labels = _k8s("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"] and policy["egress"] == []
    (rule,) = policy["ingress"]
    assert [p["port"] for p in rule["ports"]] == [c["ports"][0]["name"]]
    # only the router's pods and Prometheus's namespace come in: never the whole cluster
    router_labels = _router_pod()["metadata"]["labels"]
    sources = rule["from"]
    assert [s["podSelector"]["matchLabels"] for s in sources if "podSelector" in s] == [router_labels]
    assert all(set(s) <= {"podSelector", "namespaceSelector"} and s for s in sources)


def test_the_api_key_comes_from_an_optional_secret():
    env = {e["name"]: e for e in _container()["env"]}
    ref = env["SPYRE_SERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"], ref["optional"]) == ("spyre-serve", "api-key", True)


def _router_docs() -> list[dict]:
    return [d for f in ROUTER_FILES for d in yaml.safe_load_all(f.read_text()) if d]


def _router_pod() -> dict:
    (deployment,) = [d for d in _router_docs() if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]


def test_the_k8s_router_finds_the_replicas_with_a_namespaced_role_and_the_fleets_flags():
    docs = {d["kind"]: d for d in _router_docs()}
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "NetworkPolicy"}
    (rule,) = docs["Role"]["rules"]
    assert (rule["resources"], sorted(rule["verbs"])) == (["pods"], ["get", "list", "watch"])
    pod = _router_pod()
    assert pod["spec"]["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    (c,) = pod["spec"]["containers"]
    args = c["args"]
    replica_labels = _k8s("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = args[args.index("--selector") + 1]
    key, _, value = selector.partition("=")
    assert replica_labels[key] == value
    assert f"--service-discovery-port={_container()['ports'][0]['containerPort']}" in args
    pairs = [f"{flag}={value}" for flag, value in zip(ROUTER_FLAGS[::2], ROUTER_FLAGS[1::2], strict=True)]
    assert [a for a in args if a.split("=")[0] in ROUTER_FLAGS[::2]] == pairs
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    egress = docs["NetworkPolicy"]["spec"]["egress"]
    assert {"podSelector": {"matchLabels": replica_labels}} in egress[0]["to"]


def test_the_inference_pool_selects_the_replicas_on_the_served_port():
    pool = yaml.safe_load(POOL.read_text())
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    labels = _k8s("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": IMAGE_PORT}]
    assert pool["spec"]["endpointPickerRef"]["name"]


def test_nginx_buffers_little_more_than_the_server_takes_and_limits_each_client():
    conf = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    (size,) = re.findall(r"client_max_body_size (\d+)m;", conf)
    assert int(size) << 20 <= 2 * Settings().max_body_bytes
    assert re.search(r"limit_conn per_client \d+;", conf) and re.search(r"limit_req zone=per_client_rate", conf)
    assert "limit_conn_status 429;" in conf and "limit_req_status 429;" in conf
