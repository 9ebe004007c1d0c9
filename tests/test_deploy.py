"""The deployment files, checked offline: the Kubernetes manifests (deploy/k8s) rendered by kustomize
where a kubectl or kustomize binary is installed and every object validated against Kubernetes' JSON
schemas (kubernetes-validate), KEDA's ScaledObject against its documented shape; the compose files
against the compose spec's schema (check-jsonschema's copy); the cluster compose file's Redis part (the
cluster and rq's plain Redis) run for real, without Docker, on hosts in network namespaces (tests/hosts.py)."""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from kubernetes_validate.utils import latest_version

from lightq.cli import SERVICES, parser
from lightq.launcher import DRAIN_MARGIN_S
from shared.flags import flat_fields
from shared.keys import ROUTER_GROUP, Keys
from shared.worker_settings import WorkerSettings
from tests import hosts, hosts_compose
from tests.cluster import redis_binaries
from tests.waiting import MUST_HAPPEN_S

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = latest_version()
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.cluster.yml")
REDIS_SETTINGS = ("LIGHTQ_REDIS_URL", "LIGHTQ_REDIS_RQ_URL")
RQ_PORT = 6379  # a plain Redis's default port


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> list[dict]:
    """Every object the kustomization lists, as written (no kustomize needed)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in documents(K8S / name)]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return ["kustomize", "build"] if shutil.which("kustomize") else None


def validate(obj: dict) -> None:
    """Kubernetes' schema, strict (an unknown field is an error); KEDA's objects by their own shape."""
    if obj["apiVersion"].startswith("keda.sh/"):
        check_scaled_object(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_manifest_validates():
    objects = manifests()
    for obj in objects:
        validate(obj)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Deployment", f"lightq-{n}") for n in ("producer", "router", "worker", "rq-worker")} <= kinds
    assert ("ScaledObject", "lightq-worker") in kinds and ("Service", "lightq-producer") in kinds
    assert {("Deployment", "redis-rq"), ("Service", "redis-rq")} <= kinds


def test_kustomize_renders():
    command = kustomize_command()
    if command is None:
        pytest.skip("no kubectl or kustomize binary here: the manifests were validated as written only")
    done = subprocess.run([*command, str(K8S)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rendered = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert len(rendered) == len(manifests())
    for obj in rendered:
        validate(obj)
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "lightq"
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "lightq"


# What KEDA's ScaledObject CRD (keda.sh/v1alpha1) takes, as far as these manifests use it: its
# documented fields, nothing else (a misspelt field is an error here, as Kubernetes would reject it).
TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "additionalProperties": False,
    "properties": {
        "type": {"type": "string"},
        "name": {"type": "string"},
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "useCachedMetrics": {"type": "boolean"},
        "authenticationRef": {"type": "object"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},  # strings only
    },
}
COUNTS = ("pollingInterval", "cooldownPeriod", "initialCooldownPeriod")
COUNTS += ("minReplicaCount", "maxReplicaCount", "idleReplicaCount")
SCALED_OBJECT_SPEC = {
    "type": "object",
    "required": ["scaleTargetRef", "triggers"],
    "additionalProperties": False,
    "properties": {
        "scaleTargetRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {k: {"type": "string"} for k in ("name", "kind", "apiVersion", "envSourceContainerName")},
        },
        **{k: {"type": "integer", "minimum": 0} for k in COUNTS},
        "advanced": {"type": "object"},
        "fallback": {"type": "object"},
        "triggers": {"type": "array", "minItems": 1, "items": TRIGGER},
    },
}
# keda.sh/docs/latest/scalers/redis-cluster-streams: the parameters of its lag mode
STREAM_TRIGGER = {"addresses", "stream", "consumerGroup", "lagCount", "activationLagCount"}


def check_scaled_object(obj: dict) -> None:
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    jsonschema.validate(obj["spec"], SCALED_OBJECT_SPEC)
    hpa = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
    if "behavior" in hpa:  # the HPA's own schema: KEDA hands it over as it is
        target = {"kind": "Deployment", "name": "x", "apiVersion": "apps/v1"}
        spec = {"scaleTargetRef": target, "maxReplicas": 2, "behavior": hpa["behavior"]}
        hpa_object = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "spec": spec}
        kubernetes_validate.validate({**hpa_object, "metadata": {"name": "x"}}, K8S_VERSION, strict=True)


def test_workers_scale_on_every_ingress_streams_lag():
    objects = manifests()
    scaled = by_kind(objects, "ScaledObject")["lightq-worker"]["spec"]
    assert scaled["scaleTargetRef"]["name"] in by_kind(objects, "Deployment")
    assert scaled["minReplicaCount"] >= 1, "no worker at all: the producer refuses every request"
    triggers = scaled["triggers"]
    assert len({t["name"] for t in triggers}) == len(triggers)
    streams = {Keys("lightq").requests(p): p for p in range(-100, 101)}  # every class's name
    url = by_kind(objects, "ConfigMap")["lightq-config"]["data"]["LIGHTQ_REDIS_URL"]
    host, port = url.removeprefix("redis+cluster://").split(",")[0].split(":")
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-cluster-streams" and set(meta) == STREAM_TRIGGER, meta
        assert meta["stream"] in streams and meta["consumerGroup"] == ROUTER_GROUP
        assert int(meta["lagCount"]) > 0 and int(meta["activationLagCount"]) >= 0
        assert meta["addresses"] == f"{host}.lightq.svc.cluster.local:{port}", "lightq's Redis, from KEDA's namespace"
    assert Keys("lightq").requests(0) in {t["metadata"]["stream"] for t in triggers}


def test_redis_url_names_the_charts_service():
    values = yaml.safe_load((K8S / "redis-cluster-values.yaml").read_text())
    assert values["cluster"] == {"nodes": 6, "replicas": 1}
    url = by_kind(manifests(), "ConfigMap")["lightq-config"]["data"]["LIGHTQ_REDIS_URL"]
    assert url == f"redis+cluster://{values['fullnameOverride']}:6379"


def test_rq_url_names_the_plain_redis_service():
    """rq has no Redis Cluster client: LIGHTQ_REDIS_RQ_URL names redis-rq.yaml's Service, whose pods
    run one Redis server, not a cluster node."""
    objects = manifests()
    url = urlsplit(by_kind(objects, "ConfigMap")["lightq-config"]["data"]["LIGHTQ_REDIS_RQ_URL"])
    assert url.scheme == "redis"
    service = by_kind(objects, "Service")[url.hostname]["spec"]
    ports = [p for p in service["ports"] if p["port"] == (url.port or RQ_PORT)]
    assert len(ports) == 1, f"Service {url.hostname} has no port {url.port or RQ_PORT}"
    port = ports[0]
    deployment = by_kind(objects, "Deployment")[url.hostname]["spec"]
    assert service["selector"].items() <= deployment["template"]["metadata"]["labels"].items()
    assert deployment["replicas"] == 1
    (container,) = deployment["template"]["spec"]["containers"]
    assert container["image"].startswith("redis:7")
    args = container["args"]
    assert args[0] == "redis-server" and "--cluster-enabled" not in args
    assert port["targetPort"] in ({p["name"] for p in container["ports"]} | {port_of(args, RQ_PORT)})


def containers(objects: list[dict]) -> list[dict]:
    """The lightq containers (not redis-rq's Redis)."""
    deployments = by_kind(objects, "Deployment").values()
    every = [c for d in deployments for c in d["spec"]["template"]["spec"]["containers"]]
    return [c for c in every if c["image"] == "lightq"]


def env_names(service: str) -> set[str]:
    return {f"LIGHTQ_{flag.upper()}" for flag in flat_fields(SERVICES[service])}


def test_containers_run_lightq_with_real_flags_and_settings():
    objects = manifests()
    config = by_kind(objects, "ConfigMap")["lightq-config"]["data"]
    assert all(any(k in env_names(s) for s in SERVICES) for k in config), "a setting no service has"
    for container in containers(objects):
        args = container["args"]
        parser().parse_args(args)  # exits on an unknown command or flag
        unknown = {e["name"] for e in container.get("env", [])} - env_names(args[0])
        assert not unknown, f"{container['name']}: no such setting {unknown}"


def test_a_workers_grace_covers_its_drain():
    worker = by_kind(manifests(), "Deployment")["lightq-worker"]["spec"]["template"]["spec"]
    (container,) = worker["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    drain = float(env.get("LIGHTQ_DRAIN_TIMEOUT", WorkerSettings.model_fields["drain_timeout"].default))
    assert worker["terminationGracePeriodSeconds"] >= drain + DRAIN_MARGIN_S
    gpus = int(env.get("LIGHTQ_TP", "1"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus


def compose_schema() -> dict:
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_files_follow_the_spec(name):
    document = hosts_compose.load(ROOT / name)
    jsonschema.validate(document, compose_schema())
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        done = subprocess.run([docker, "compose", "-f", str(ROOT / name), "config", "-q"], capture_output=True)
        assert done.returncode == 0, done.stderr


def split_redis(service: dict) -> tuple[dict, dict[str, str], object]:
    """(the service without its Redis URLs and dependencies, the URLs by setting, the dependencies)."""
    service = copy.deepcopy(service)
    env = service["environment"]
    urls = {name: env.pop(name) for name in REDIS_SETTINGS if name in env}
    return service, urls, service.pop("depends_on", None)


def test_the_cluster_file_runs_the_single_node_files_services():
    single = hosts_compose.load(ROOT / "docker-compose.yml")["services"]
    cluster = hosts_compose.load(ROOT / "docker-compose.cluster.yml")["services"]
    for name in ("producer", "router", "worker", "rq-worker"):
        ours, urls, depends = split_redis(cluster[name])
        theirs, single_urls, _ = split_redis(single[name])
        assert ours == theirs, f"{name} differs from docker-compose.yml's beyond its Redis"
        assert set(single_urls) == {"LIGHTQ_REDIS_URL"} and single_urls["LIGHTQ_REDIS_URL"].startswith("redis://")
        assert urls["LIGHTQ_REDIS_URL"].startswith("redis+cluster://")
        assert urls["LIGHTQ_REDIS_RQ_URL"] == f"redis://redis-rq:{RQ_PORT}/0"
        wanted = {"redis-cluster-init": {"condition": "service_completed_successfully"}}
        if name in ("producer", "rq-worker"):  # batch records and rq's queue; router and workers: neither
            wanted["redis-rq"] = {"condition": "service_started"}
        assert depends == wanted, name


def test_the_cluster_files_rq_redis_is_a_plain_server():
    document = hosts_compose.load(ROOT / "docker-compose.cluster.yml")
    url = urlsplit(document["services"]["producer"]["environment"]["LIGHTQ_REDIS_RQ_URL"])
    command = hosts_compose.argv(document["services"][url.hostname])
    assert command[0] == "redis-server" and "--cluster-enabled" not in command
    assert command[command.index("--appendonly") + 1] == "yes"
    assert port_of(command, RQ_PORT) == (url.port or RQ_PORT)
    assert document["services"][url.hostname]["volumes"] == [f"{url.hostname}:/data"]
    assert url.hostname in document["volumes"]


# In the producer's host: the compose file's LIGHTQ_REDIS_URL as startup nodes (names, resolved as in
# compose), a key on every slot owner written and read back, and what the cluster told the client.
CLUSTER_CLIENT = """
import json, sys
from redis.cluster import ClusterNode, RedisCluster
hosts = [a.rsplit(":", 1) for a in sys.argv[1].removeprefix("redis+cluster://").split(",")]
client = RedisCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in hosts], decode_responses=True)
keys = [f"lightq:{{r:{i}}}:meta" for i in range(64)]
for i, key in enumerate(keys):
    client.set(key, i)
read = [client.get(key) for key in keys] == [str(i) for i in range(len(keys))]
hosts = sorted(n.host for n in client.get_nodes())
print(json.dumps({"read": read, "primaries": len(client.get_primaries()), "hosts": hosts}))
"""


def test_the_cluster_files_redis_part_forms_a_cluster_on_hosts(tmp_path):
    """docker-compose.cluster.yml's six nodes and its init service, run as written (their command
    lines and environment; this machine's redis 7.0 for the image's redis:7), each on a host of its
    own at its fixed address; then a second `up`: the init finds the cluster formed. rq's plain Redis
    (redis-rq) too, on a host of its own, reached by the producer through LIGHTQ_REDIS_RQ_URL."""
    reason = hosts.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        cli = redis_binaries()[1]
    except RuntimeError as exc:
        pytest.skip(str(exc))
    names = [f"redis-{i}" for i in range(1, 7)]
    numbers = {name: 10 + i for i, name in enumerate(names, 1)} | {"redis-cluster-init": 20, "producer": 21}
    numbers["redis-rq"] = 22  # no fixed address in the file: any
    with hosts.Network([*names, "redis-cluster-init", "producer", "redis-rq"], numbers) as net:
        env = {"LIGHTQ_NET": str(net.subnet.network_address).rsplit(".", 1)[0]}
        services = hosts_compose.load(ROOT / "docker-compose.cluster.yml", env)["services"]
        path = {**os.environ, "PATH": f"{os.path.dirname(cli)}:{os.environ['PATH']}"}  # a 7.x first
        for name in names:
            assert services[name]["networks"]["default"]["ipv4_address"] == net[name].address
            (tmp_path / name).mkdir()  # the image's /data
            command = hosts_compose.argv(services[name])
            net[name].popen(command, cwd=tmp_path / name, env=path, stdout=subprocess.DEVNULL)
        (tmp_path / "redis-rq").mkdir()
        rq_command = hosts_compose.argv(services["redis-rq"])
        net["redis-rq"].popen(rq_command, cwd=tmp_path / "redis-rq", env=path, stdout=subprocess.DEVNULL)
        init = services["redis-cluster-init"]

        def up() -> subprocess.CompletedProcess:
            init_env = {**path, **hosts_compose.environment(init)}
            command = hosts_compose.argv(init)
            init_host = net["redis-cluster-init"]
            return init_host.run(command, env=init_env, capture_output=True, text=True, timeout=MUST_HAPPEN_S)

        first = up()
        assert first.returncode == 0 and first.stdout.endswith("the cluster is formed\n"), first.stdout + first.stderr
        url = services["producer"]["environment"]["LIGHTQ_REDIS_URL"]
        done = net["producer"].run([sys.executable, "-c", CLUSTER_CLIENT, url], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        told = json.loads(done.stdout)
        assert told["read"] and told["primaries"] == 3
        assert told["hosts"] and set(told["hosts"]) <= set(names), "nodes announce their names, not addresses"
        roles = [node_role(net[n].address, port_of(hosts_compose.argv(services[n]))) for n in names]
        assert sorted(roles) == ["master"] * 3 + ["slave"] * 3
        again = up()
        assert again.returncode == 0 and "formed already" in again.stdout, again.stdout + again.stderr
        rq_url = services["producer"]["environment"]["LIGHTQ_REDIS_RQ_URL"]
        done = net["producer"].run([sys.executable, "-c", RQ_CLIENT, rq_url], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"read": True, "cluster_enabled": 0, "aof_enabled": 1}


# In the producer's host: the compose file's LIGHTQ_REDIS_RQ_URL with a plain client (as rq's), a key
# written and read back, and whether that server is a cluster node and keeps an append-only file.
RQ_CLIENT = """
import json, sys, time
from redis import Redis
client = Redis.from_url(sys.argv[1], decode_responses=True, socket_timeout=5)
for _ in range(100):  # the server may still be starting
    try:
        client.ping()
        break
    except Exception:
        time.sleep(0.1)
client.set("lightq:rq-probe", "1")
read = client.get("lightq:rq-probe") == "1"
told = {"cluster_enabled": client.info("cluster")["cluster_enabled"]}
told["aof_enabled"] = client.info("persistence")["aof_enabled"]
print(json.dumps({"read": read, **told}))
"""


def port_of(command: list[str], default: int | None = None) -> int:
    if "--port" not in command and default is not None:
        return default
    return int(command[command.index("--port") + 1])


def node_role(address: str, port: int) -> str:
    with redis.Redis(address, port, socket_timeout=5) as client:
        return client.info("replication")["role"]
