"""The cluster configuration in infra/k8s and infra/deepspeed parses and is consistent: generated
files are current, every image is the declared one, every Secret/ConfigMap/key/volume a pod or
the Dagster Helm values reference exists, and the training Job's node layout matches its recipe."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from infra import deepspeed_configs
from pipelines.common.config import load_config
from pipelines.common.launch import add_launch_arguments
from pipelines.common.workspace import PROJECT_ROOT
from sapiens2.train.engine import build_deepspeed_config

K8S = PROJECT_ROOT / "infra" / "k8s"


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization: dict) -> list[dict]:
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


@pytest.fixture(scope="module")
def secrets_example() -> list[dict]:
    """The Secret shapes: created once outside kustomize (an apply -k would blank real values)."""
    return [doc for doc in yaml.safe_load_all((K8S / "secrets.example.yaml").read_text()) if doc]


@pytest.fixture(scope="module")
def image(kustomization: dict) -> str:
    (entry,) = kustomization["images"]
    assert entry["newTag"] not in ("", "latest")
    return f"{entry['name']}:{entry['newTag']}"


def _defined(objects: list[dict], kind: str) -> dict[str, set[str]]:
    out = {}
    for obj in objects:
        if obj["kind"] == kind:
            out[obj["metadata"]["name"]] = set(obj.get("data", {})) | set(obj.get("stringData", {}))
    return out


def _pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects if o["kind"] in ("Deployment", "Job")]


def test_generated_deepspeed_configs_are_current() -> None:
    for path, text in deepspeed_configs.render().items():
        assert path.read_text() == text, f"{path} is stale: run `python -m infra.deepspeed_configs`"
    on_disk = {p.name for p in deepspeed_configs.CONFIG_DIR.iterdir()}
    assert on_disk == {f"{arch}.{ext}" for arch in deepspeed_configs.RECIPES for ext in ("json", "yaml")}
    for arch in deepspeed_configs.RECIPES:
        config = load_config(deepspeed_configs.CONFIG_DIR / f"{arch}.yaml")
        assert config.pretrain.arch == arch
        ds_json = json.loads((deepspeed_configs.CONFIG_DIR / f"{arch}.json").read_text())
        assert ds_json == build_deepspeed_config(config.pretrain.deepspeed, config.pretrain.optim)
        assert ds_json["train_batch_size"] == 4096
        assert ds_json["zero_optimization"]["stage"] == deepspeed_configs.RECIPES[arch].zero_stage


def test_every_manifest_is_listed_and_parses(kustomization: dict, objects: list[dict]) -> None:
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "dagster-values.yaml", "secrets.example.yaml"}
    assert listed == present
    assert not [o for o in objects if o["kind"] == "Secret"], "kustomize must not apply (and blank) the Secrets"
    assert all({"apiVersion", "kind", "metadata"} <= set(o) for o in objects)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


def test_pods_reference_only_defined_images_secrets_configmaps_and_volumes(
        objects: list[dict], secrets_example: list[dict], image: str) -> None:
    secrets, configmaps = _defined(secrets_example, "Secret"), _defined(objects, "ConfigMap")
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    checked = 0
    for owner, spec in _pod_specs(objects):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for vol in volumes.values():
            if "configMap" in vol:
                assert vol["configMap"]["name"] in configmaps, (owner, vol)
            if "secret" in vol:
                assert vol["secret"]["secretName"] in secrets, (owner, vol)
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims, (owner, vol)
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["image"] == image, (owner, container["name"])
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, (owner, source)
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in configmaps, (owner, source)
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["key"] in secrets[ref["secretKeyRef"]["name"]], (owner, env)
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["key"] in configmaps[ref["configMapKeyRef"]["name"]], (owner, env)
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (owner, mount)
            checked += 1
    assert checked == 3  # mlflow, the training init container and trainer
    assert all(v == "" for keys in secrets for v in _secret_values(secrets_example, keys)), "secret values are committed"


def _secret_values(objects: list[dict], name: str) -> list[str]:
    obj = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == name)
    return list(obj.get("stringData", {}).values()) + list(obj.get("data", {}).values())


def test_dagster_helm_values(objects: list[dict], secrets_example: list[dict], image: str) -> None:
    values = yaml.safe_load((K8S / "dagster-values.yaml").read_text())
    secrets, configmaps = _defined(secrets_example, "Secret"), _defined(objects, "ConfigMap")
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    for holder in (launcher, deployment):
        assert all(s["name"] in secrets for s in holder["envSecrets"])
        assert all(c["name"] in configmaps for c in holder["envConfigMaps"])
    assert f"{deployment['image']['repository']}:{deployment['image']['tag']}" == image
    assert "postgresql-password" in secrets[values["global"]["postgresqlSecretName"]]
    assert values["postgresql"]["enabled"] is False and values["generatePostgresqlPasswordSecret"] is False
    module = deployment["dagsterApiGrpcArgs"][deployment["dagsterApiGrpcArgs"].index("-m") + 1]
    pyproject = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    assert module == pyproject["tool"]["dagster"]["module_name"]
    dagster_yaml = yaml.safe_load((PROJECT_ROOT / "dagster.yaml").read_text())
    limits = values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]["tagConcurrencyLimits"]
    assert limits == dagster_yaml["concurrency"]["runs"]["tag_concurrency_limits"]


def _flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def test_training_job_layout_matches_its_recipe(objects: list[dict]) -> None:
    job = next(o for o in objects if o["kind"] == "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    flags = _flags(trainer["command"])
    nodes, gpus = int(flags["nnodes"]), int(trainer["resources"]["limits"]["nvidia.com/gpu"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
    assert flags["node-rank"] == "$(NODE_RANK)"
    assert any(e["name"] == "NODE_RANK" and "job-completion-index" in e["valueFrom"]["fieldRef"]["fieldPath"]
               for e in trainer["env"])

    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert flags["master-addr"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert int(flags["master-port"]) == service["spec"]["ports"][0]["port"]

    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    recipe_path = Path(flags["config"])
    recipes = configmaps[volumes[mounts[str(recipe_path.parent)]]["configMap"]["name"]]["data"]
    config = load_config_text(recipes[recipe_path.name])
    assert config.pretrain.arch == job["metadata"]["labels"]["sapiens2/recipe"]
    assert config.pretrain.deepspeed.world_size == nodes * gpus  # the launcher starts world/nnodes ranks per pod
    ds_json = json.loads(recipes[recipe_path.with_suffix(".json").name])
    assert ds_json == build_deepspeed_config(config.pretrain.deepspeed, config.pretrain.optim)

    # The pod runs the launcher every other caller runs (no hidden rank-side entry point), and
    # that launcher accepts exactly these flags.
    command = trainer["command"]
    assert command[:3] == ["python", "-m", "pipelines.pretrain"] and "--rank-worker" not in command
    parser = argparse.ArgumentParser()
    parser.add_argument("--curated", required=True)
    parser.add_argument("--output", required=True)
    add_launch_arguments(parser)
    parsed = parser.parse_args([a.replace("$(NODE_RANK)", "3") for a in command[3:]])
    assert (parsed.nnodes, parsed.node_rank) == (nodes, 3)


def load_config_text(text: str):
    return deepspeed_configs.load_config_dict(yaml.safe_load(text))


def test_mlflow_deployment_uses_postgres_secret_and_the_bucket(objects: list[dict]) -> None:
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "mlflow")
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "mlflow")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["containerPort"]
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == "sapiens2-mlflow-db"
    assert "--backend-store-uri" not in container["command"]  # a DSN in argv would be readable by all
    services = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "sapiens2-services")["data"]
    destination = container["command"][container["command"].index("--artifacts-destination") + 1]
    prefix = f"s3://{services['SAPIENS2_S3_BUCKET']}/{services['SAPIENS2_S3_PREFIX']}"
    assert destination == f"{prefix}/mlflow" and services["SAPIENS2_DVC_REMOTE"] == f"{prefix}/dvc"
    assert services["SAPIENS2_CHECKPOINT_STORE"] == f"{prefix}/checkpoints"
    assert services["MLFLOW_TRACKING_URI"] == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"


def test_cluster_runs_the_same_definitions_on_the_kubernetes_executor(objects: list[dict], secrets_example: list[dict]) -> None:
    """The ConfigMap selects dagster-k8s's executor; the definitions load with it unchanged, and
    the config maps and secrets it passes to step pods are the ones the manifests define."""
    services = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "sapiens2-services")
    assert services["data"]["SAPIENS2_EXECUTOR"] == "k8s"
    env = {**os.environ, "SAPIENS2_EXECUTOR": "k8s"}
    # validate_run_config resolves the configured executor's settings against dagster-k8s's schema.
    probe = ("import dagster as dg; from assets.definitions import defs; dg.Definitions.validate_loadable(defs); "
             "jobs = {j: defs.resolve_job_def(j) for j in ('end_to_end', 'filter_shards')}; "
             "[dg.validate_run_config(job, {}) for job in jobs.values()]; "
             "print({name: job.executor_def.name for name, job in jobs.items()})")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "{'end_to_end': 'k8s', 'filter_shards': 'k8s'}"
    names = {(o["kind"], o["metadata"]["name"]) for o in objects + secrets_example}
    assert {("ConfigMap", "sapiens2-services"), ("Secret", "sapiens2-s3")} <= names
    # Run pods (Helm values) and step pods (the executor) share one workspace volume.
    from assets.definitions import K8S_WORKSPACE_CLAIM

    assert ("PersistentVolumeClaim", K8S_WORKSPACE_CLAIM) in names
    claim = next(o for o in objects if o["metadata"]["name"] == K8S_WORKSPACE_CLAIM)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    run_pods = yaml.safe_load((K8S / "dagster-values.yaml").read_text())["runLauncher"]["config"]["k8sRunLauncher"]
    volume = next(v for v in run_pods["runK8sConfig"]["podSpecConfig"]["volumes"] if v["name"] == "workspace")
    mount = next(m for m in run_pods["runK8sConfig"]["containerConfig"]["volumeMounts"] if m["name"] == "workspace")
    assert volume["persistentVolumeClaim"]["claimName"] == K8S_WORKSPACE_CLAIM
    assert mount["mountPath"] == services["data"]["SAPIENS2_WORKSPACE"] == "/workspace"
    bad = subprocess.run([sys.executable, "-c", "import assets.definitions"], capture_output=True, text=True,
                         env={**os.environ, "SAPIENS2_EXECUTOR": "slurm"})
    assert bad.returncode != 0 and "SAPIENS2_EXECUTOR='slurm'" in bad.stderr


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * _UNITS.get(unit, 1)


def _check_container_security(where: str, security: dict) -> None:
    assert security.get("allowPrivilegeEscalation") is False, where
    assert security.get("readOnlyRootFilesystem") is True, where
    assert security.get("capabilities", {}).get("drop") == ["ALL"], where


def test_every_pod_runs_unprivileged_with_bounded_resources(objects: list[dict]) -> None:
    for owner, spec in _pod_specs(objects):
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) > 0, owner
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, owner
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{owner}/{container['name']}"
            _check_container_security(where, container.get("securityContext", {}))
            requests, limits = container["resources"]["requests"], container["resources"]["limits"]
            assert {"cpu", "memory"} <= set(requests) and "memory" in limits, where
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
            assert "emptyDir" in mounts.get("/tmp", {}), f"{where}: a read-only root needs a writable /tmp"
            in_memory = sum(_bytes(v["emptyDir"].get("sizeLimit", "0")) for v in mounts.values()
                            if v.get("emptyDir", {}).get("medium") == "Memory")
            assert in_memory < _bytes(limits["memory"]), f"{where}: /dev/shm must fit in the memory limit"

    values = yaml.safe_load((K8S / "dagster-values.yaml").read_text())
    run_pods = values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    _check_container_security("dagster run pods", run_pods["containerConfig"]["securityContext"])
    assert run_pods["containerConfig"]["securityContext"]["runAsNonRoot"] is True
    from assets.definitions import k8s_step_pods

    _check_container_security("dagster step pods", k8s_step_pods([])["security_context"])


def test_network_policies_deny_by_default_and_admit_only_mlflow_clients(objects: list[dict]) -> None:
    from assets.definitions import K8S_MLFLOW_CLIENT_LABEL, k8s_step_pods

    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert {"podSelector": {}, "policyTypes": ["Ingress"]} in policies.values(), "no default-deny policy"
    mlflow = next(p for p in policies.values() if p["podSelector"].get("matchLabels") == {"app": "mlflow"})
    (rule,) = mlflow["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": K8S_MLFLOW_CLIENT_LABEL}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 5000}]
    job = next(o for o in objects if o["kind"] == "Job")
    assert K8S_MLFLOW_CLIENT_LABEL.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    training = next(p for p in policies.values() if p["podSelector"].get("matchLabels") == {"job-name": job["metadata"]["name"]})
    assert training["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"job-name": job["metadata"]["name"]}}}]}]
    values = yaml.safe_load((K8S / "dagster-values.yaml").read_text())
    run_pods = values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    assert run_pods["podTemplateSpecMetadata"]["labels"] == K8S_MLFLOW_CLIENT_LABEL
    assert k8s_step_pods([])["labels"] == K8S_MLFLOW_CLIENT_LABEL
