"""The platform as a team uses it, in a real browser (Debian's chromium driven by Playwright).

The stack starts through `python -m infra.stack up` on free loopback ports, its steps working in
a small-recipe workspace. In the Dagster UI the `end_to_end` job is launched by clicking
"Materialize all", and a second run of it (another fine-tuning seed) is submitted through
GraphQL at once: the instance queues it behind the first, and every version either run registered
carries the evaluation of its own weights (by hash). Once the runs have succeeded the MLflow UI
shows the runs, their metrics and the registered (development and production) models. Afterwards no trace of the S3 secret key
may be found in the service logs, MLflow params and tags, Dagster's event metadata, its
storage, the workspace or the bucket. Screenshots go to `reports/test-artifacts/ui/` (or
`$SAPIENS2_TEST_ARTIFACTS/ui`); the stack is stopped by pid whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import dagster as dg
import mlflow
import pytest
from mlflow import MlflowClient

from assets.definitions import ALL_ASSETS
from infra import health
from pipelines.common.config import TASK_NAMES
from pipelines.common.eval_report import REPORT_TAG, report_sha256
from pipelines.common.lineage import model_sha256
from pipelines.common.services import ServiceSettings
from pipelines.common.workspace import PROJECT_ROOT
from tests.conftest import SMALL_RECIPE, free_ports, make_workspace

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SECRET = "ui-stack-s3cr3t-5d21c0"
BUCKET = "ui-test"
RUN_TIMEOUT_S = 2400  # generous: a loaded 2-core machine runs it several times slower
UI_TIMEOUT_MS = 60_000
# The run submitted beside the clicked one: another fine-tuning seed, so its weights (and hashes)
# differ from the first run's and a version tagged with the other run's evaluation would show.
SECOND_RUN_CONFIG = {"resources": {"platform": {"config": {"finetune": {"seed": 1}}}}}
LAUNCH_RUN = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) { __typename
  ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } } }"""
REPOSITORIES = "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }"


@dataclass(frozen=True)
class Stack:
    env: dict[str, str]
    settings: ServiceSettings
    workspace: Path
    state: Path
    dagster_home: Path

    @property
    def dagster_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.dagster_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.mlflow_port}"


@dataclass(frozen=True)
class UiRun:
    run_id: str  # launched by the click
    status: str
    seconds: float
    second_run_id: str  # submitted through GraphQL right after the click
    second_status: str


def _stack_cli(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.stack", *args], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def artifacts() -> Path:
    root = Path(os.environ.get("SAPIENS2_TEST_ARTIFACTS", PROJECT_ROOT / "reports" / "test-artifacts")) / "ui"
    root.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {root}")
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} missing: install Debian's chromium (`apt-get install -y chromium`; .ci/run does)")
    root = tmp_path_factory.mktemp("ui-stack")
    workspace = make_workspace(root / "ws", SMALL_RECIPE)
    s3_port, mlflow_port, dagster_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_", "SAPIENS2_", "DAGSTER_"))}
    env.update({
        "SAPIENS2_STACK_DIR": str(root / "stack"), "DAGSTER_HOME": str(root / "dagster_home"),
        "SAPIENS2_WORKSPACE": str(workspace), "SAPIENS2_S3_PORT": str(s3_port),
        "SAPIENS2_MLFLOW_PORT": str(mlflow_port), "SAPIENS2_DAGSTER_PORT": str(dagster_port),
        "SAPIENS2_S3_BUCKET": BUCKET, "AWS_ACCESS_KEY_ID": "ui-test-key", "AWS_SECRET_ACCESS_KEY": SECRET,
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    settings = ServiceSettings(host="127.0.0.1", s3_port=s3_port, mlflow_port=mlflow_port, dagster_port=dagster_port,
                               bucket=BUCKET, prefix="", region="us-east-1", s3_endpoint_url=None,
                               access_key_id="ui-test-key", secret_access_key=SECRET)
    started = time.monotonic()
    try:
        up = _stack_cli(env, "up", "--timeout", "300")
        assert up.returncode == 0, up.stderr[-4000:]
        print(f"stack up in {time.monotonic() - started:.0f} s")
        yield Stack(env, settings, workspace, root / "stack", root / "dagster_home")
    finally:
        down = _stack_cli(env, "down", timeout=120)
        assert down.returncode == 0, down.stderr
        assert "stopped" in _stack_cli(env, "status").stdout


@pytest.fixture(scope="module")
def page(artifacts: Path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield page
        finally:
            browser.close()


def _shot(page, artifacts: Path, name: str) -> None:
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot {path}")


def _run_status(stack: Stack, run_id: str) -> str:
    query = '{ runOrError(runId: "%s") { __typename ... on Run { status } } }' % run_id
    return health.graphql(stack.settings, query)["data"]["runOrError"]["status"]


def _job_runs(stack: Stack, fields: str = "runId status") -> list[dict]:
    query = '{ runsOrError(filter: {pipelineName: "end_to_end"}) { ... on Runs { results { %s } } } }' % fields
    return health.graphql(stack.settings, query)["data"]["runsOrError"]["results"]


def _launch_end_to_end(stack: Stack, run_config: dict) -> str:
    """Submit an `end_to_end` run through GraphQL, as a script or another user would."""
    (repository,) = health.graphql(stack.settings, REPOSITORIES)["data"]["repositoriesOrError"]["nodes"]
    params = {"selector": {"repositoryLocationName": repository["location"]["name"],
                           "repositoryName": repository["name"], "jobName": "end_to_end"},
              "runConfigData": run_config}
    answer = health.graphql(stack.settings, LAUNCH_RUN, variables={"params": params})["data"]["launchRun"]
    assert answer["__typename"] == "LaunchRunSuccess", answer
    return answer["run"]["runId"]


@pytest.fixture(scope="module")
def ui_run(stack: Stack, page, artifacts: Path) -> UiRun:
    """Open the Dagster UI, launch `end_to_end` with "Materialize all", wait for the run to end."""
    from playwright.sync_api import expect

    assert _job_runs(stack) == []
    page.goto(stack.dagster_url)
    expect(page.get_by_role("link", name="Jobs")).to_be_visible()
    skip = page.get_by_role("button", name="Skip")  # the "Join the Dagster community" dialog
    try:
        skip.wait_for(state="visible", timeout=10_000)
        skip.click()
    except Exception:  # noqa: BLE001 - the dialog is not shown once dismissed on this instance
        pass
    page.get_by_role("link", name="Jobs").click()
    page.get_by_role("link", name="end_to_end").first.click()
    materialize = page.get_by_role("button", name="Materialize all")
    expect(materialize).to_be_enabled()
    _shot(page, artifacts, "01-dagster-job")
    started = time.monotonic()
    materialize.click()
    toast = page.locator("a[href^='/runs/']").filter(has_text=re.compile("^View$"))  # "Launched run ... View"
    expect(toast).to_be_visible()
    run_id = toast.get_attribute("href").rsplit("/", 1)[-1]
    assert re.fullmatch(r"[0-9a-f-]{36}", run_id), run_id
    second_run_id = _launch_end_to_end(stack, SECOND_RUN_CONFIG)  # while the first is queued or running
    toast.click()
    expect(page).to_have_url(re.compile(f"/runs/{run_id}"))
    _shot(page, artifacts, "02-dagster-run-launched")
    run_url = page.url
    page.goto("about:blank")  # a live run page keeps a renderer busy on one of the two cores

    ended = ("SUCCESS", "FAILURE", "CANCELED")
    statuses = {run: _run_status(stack, run) for run in (run_id, second_run_id)}
    while not set(statuses.values()) <= set(ended) and time.monotonic() - started < 2 * RUN_TIMEOUT_S:
        time.sleep(10)
        statuses = {run: _run_status(stack, run) for run in (run_id, second_run_id)}
    seconds = time.monotonic() - started
    print(f"end_to_end runs {statuses} after {seconds:.0f} s")
    page.goto(run_url)
    expect(page.get_by_text(re.compile(r"^Succeeded \([1-9][0-9]*\)$"))).to_be_visible()  # logs loaded
    _shot(page, artifacts, "03-dagster-run-finished")
    return UiRun(run_id, statuses[run_id], seconds, second_run_id, statuses[second_run_id])


def test_materialize_all_clicked_in_dagster_runs_the_job_to_success(stack: Stack, ui_run: UiRun, page,
                                                                     artifacts: Path) -> None:
    from playwright.sync_api import expect

    assert ui_run.status == "SUCCESS", f"run {ui_run.run_id} ended {ui_run.status}; logs in {stack.state / 'logs'}"
    assert ui_run.second_status == "SUCCESS", f"run {ui_run.second_run_id} ended {ui_run.second_status}"
    # The click launched exactly one run; the other is the one submitted through GraphQL.
    assert sorted(r["runId"] for r in _job_runs(stack)) == sorted([ui_run.run_id, ui_run.second_run_id])
    expect(page.get_by_text("Success").first).to_be_visible()
    page.get_by_role("link", name="Catalog").click()
    search = page.get_by_role("textbox", name="Search and filter assets")
    for asset in ("registered_models", "champion_models", *(f"finetuned_{t}" for t in TASK_NAMES)):
        search.fill(asset)  # the catalog list is virtualised: rows off screen are not rendered
        row = page.locator(f"a[href='/assets/{asset}']").first
        expect(row).to_be_visible()
        expect(row.locator("xpath=ancestor::*[contains(., 'Materialized')][1]")).to_be_visible()
    search.fill("")
    _shot(page, artifacts, "04-dagster-catalog")
    # The pool's shard is a partition of shard_scores, materialised by the run's curated_dataset step.
    page.goto(f"{stack.dagster_url}/assets/shard_scores?view=partitions")
    expect(page.get_by_text("pool-00000").first).to_be_visible()
    expect(page.get_by_text("Materialized (1)")).to_be_visible()
    _shot(page, artifacts, "04b-dagster-shard-partitions")
    instance = dg.DagsterInstance.from_config(str(stack.dagster_home))
    materialized = {e.dagster_event.asset_key.to_user_string() for e in instance.all_logs(ui_run.run_id)
                    if e.dagster_event and e.dagster_event.is_step_materialization}
    assert materialized == {a.key.to_user_string() for a in ALL_ASSETS} | {"shard_scores"}  # its partitions
    pose = instance.get_latest_materialization_event(dg.AssetKey("finetuned_pose"))
    assert pose.run_id in (ui_run.run_id, ui_run.second_run_id)
    uri = pose.asset_materialization.metadata["checkpoint_uri"].value
    assert uri == f"s3://{BUCKET}/checkpoints/finetune/pose/{pose.run_id}/checkpoint.json"
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{stack.settings.s3_port}", region_name="us-east-1",
                      aws_access_key_id="ui-test-key", aws_secret_access_key=SECRET)
    keys = [o["Key"] for page_ in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page_.get("Contents", [])]
    assert any(k.startswith("dvc/") for k in keys) and any(k.startswith("mlflow/") for k in keys)
    manifests = sorted(k for k in keys if k.startswith("checkpoints/") and k.endswith("/checkpoint.json"))
    assert manifests == sorted(
        manifest for run in (ui_run.run_id, ui_run.second_run_id)
        for manifest in (f"checkpoints/pretrain/{run}/checkpoint.json",
                         *(f"checkpoints/finetune/{t}/{run}/checkpoint.json" for t in TASK_NAMES)))


def _model_dir(download: str) -> Path:
    (weights,) = Path(download).rglob("model.safetensors")
    return weights.parent


def test_two_runs_submitted_together_register_each_version_with_its_own_evaluation(
        stack: Stack, ui_run: UiRun, tmp_path: Path) -> None:
    assert (ui_run.status, ui_run.second_status) == ("SUCCESS", "SUCCESS")
    times = {r["runId"]: r for r in _job_runs(stack, "runId startTime endTime")}
    first, second = sorted(times.values(), key=lambda r: r["startTime"])
    # One at a time on the one workspace: dagster.yaml's run limit queued the second run until
    # the first had ended, so no step of one deleted or rewrote a folder the other was using.
    assert second["startTime"] >= first["endTime"], times
    client = MlflowClient(tracking_uri=stack.mlflow_url, registry_uri=stack.mlflow_url)
    mlflow.set_tracking_uri(stack.mlflow_url)
    evaluations = {run.data.tags[REPORT_TAG]: run for run in client.search_runs(
        [e.experiment_id for e in client.search_experiments()], f"tags.`{REPORT_TAG}` LIKE '%'")}
    assert len(evaluations) == 2  # one report per run, told apart by their bytes' hash
    reports = {}
    for sha, run in evaluations.items():
        report_file = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="metrics.json",
                                                               dst_path=str(tmp_path / sha)))
        assert report_sha256(report_file) == sha
        reports[sha] = {t["task"]: t for t in json.loads(report_file.read_text())["tasks"]}
    for task in TASK_NAMES:
        versions = client.search_model_versions(f"name = 'sapiens2-{task}'")
        assert sorted(v.tags["dagster_run_id"] for v in versions) == sorted(times), task
        weights = {}
        for version in versions:
            files = mlflow.artifacts.download_artifacts(f"models:/sapiens2-{task}/{version.version}",
                                                        dst_path=str(tmp_path / task / version.version))
            weights[version.version] = model_sha256(_model_dir(files))
            assert weights[version.version] == version.tags["model.sha256"], (task, version.version)
            scored = reports[version.tags[REPORT_TAG]][task]  # the report this version was registered from
            assert scored["model_sha256"] == weights[version.version], (task, version.version)
            primary = scored["primary_metric"]
            assert float(version.tags[f"eval.{primary}"]) == pytest.approx(scored["metrics"][primary])
        assert len(set(weights.values())) == 2, task  # the seeds differ, so a mix-up would show
        champion = client.get_model_version_by_alias(f"sapiens2-{task}-production", "champion")
        source = champion.tags["promotion.source"].rsplit("/", 1)[-1]
        files = mlflow.artifacts.download_artifacts(f"models:/sapiens2-{task}-production/{champion.version}",
                                                    dst_path=str(tmp_path / f"{task}-production"))
        assert model_sha256(_model_dir(files)) == weights[source], task  # production holds evaluated bytes


def test_mlflow_ui_shows_runs_metrics_and_registered_models(stack: Stack, ui_run: UiRun, page,
                                                            artifacts: Path) -> None:
    from playwright.sync_api import expect

    assert ui_run.status == "SUCCESS"
    page.goto(f"{stack.mlflow_url}/#/experiments")
    page.get_by_role("button", name="Model training").click()  # the classic runs / registry views
    experiment = page.get_by_role("link", name="sapiens2/finetune", exact=True)
    expect(experiment).to_be_visible()
    _shot(page, artifacts, "05-mlflow-experiments")
    experiment.click()
    runs = {task: page.locator("a[href*='/runs/']").filter(has_text=re.compile(f"^{task}$")).first for task in TASK_NAMES}
    for run in runs.values():
        expect(run).to_be_visible()
    _shot(page, artifacts, "06-mlflow-finetune-runs")
    runs["seg"].click()
    expect(page.get_by_text(re.compile(r"^Metrics \(\d+\)$"))).to_be_visible()
    expect(page.get_by_text("loss", exact=True).first).to_be_visible()  # the training loss, logged every log_every steps
    _shot(page, artifacts, "07-mlflow-seg-run")
    page.get_by_role("tab", name="Model metrics").click()
    _shot(page, artifacts, "08-mlflow-seg-metric-charts")

    page.goto(f"{stack.mlflow_url}/#/models")
    announcement = page.get_by_role("dialog")  # "the new Model Registry UI", shown once per browser
    try:
        announcement.wait_for(state="visible", timeout=10_000)
        page.keyboard.press("Escape")
        expect(announcement).to_be_hidden()
    except Exception:  # noqa: BLE001 - not shown
        pass
    for task in TASK_NAMES:
        expect(page.get_by_role("link", name=f"sapiens2-{task}", exact=True)).to_be_visible()
        expect(page.get_by_role("link", name=f"sapiens2-{task}-production", exact=True)).to_be_visible()
        champion = page.locator(f"a[href*='/models/sapiens2-{task}-production/versions/']").filter(has_text="champion")
        expect(champion).to_be_visible()
    _shot(page, artifacts, "09-mlflow-registered-models")
    champion.click()
    expect(page.get_by_text("Copied from")).to_be_visible()
    expect(page.get_by_text("promotion.reason", exact=True)).to_be_visible()
    _shot(page, artifacts, "10-mlflow-production-champion")


def _files_with(secret: bytes, roots: list[Path], skip: set[Path]) -> list[str]:
    """Every regular file under `roots` (symlinks not followed) whose bytes contain `secret`."""
    found = []
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder) / name
                if path.is_file() and not path.is_symlink() and path not in skip and secret in path.read_bytes():
                    found.append(str(path))
    return found


def test_no_secret_in_logs_mlflow_dagster_metadata_or_storage(stack: Stack, ui_run: UiRun) -> None:
    assert ui_run.status == "SUCCESS"
    secret = SECRET.encode()
    env_file = stack.state / "env"
    # The scan finds the secret where it is meant to be: the stack's client env file (mode 0600).
    assert _files_with(secret, [stack.state], set()) == [str(env_file)]
    assert _files_with(secret, [stack.state, stack.dagster_home, stack.workspace], {env_file}) == []

    client = MlflowClient(tracking_uri=stack.mlflow_url, registry_uri=stack.mlflow_url)
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments], max_results=1000)
    assert len(runs) >= 1 + len(TASK_NAMES) + 1  # pretraining, each fine-tuning, evaluation, registrations
    assert sum(len(r.data.params) for r in runs) > 50
    finetune_runs = [r for r in runs if r.data.tags.get("mlflow.runName") in TASK_NAMES and "checkpoint.uri" in r.data.tags]
    assert len(finetune_runs) == 2 * len(TASK_NAMES)  # two end_to_end runs
    for run in runs:
        recorded = {**run.data.params, **run.data.tags}
        assert not [k for k, v in recorded.items() if SECRET in str(v) or SECRET in k], run.info.run_id
    models = client.search_registered_models()
    assert len(models) == 2 * len(TASK_NAMES)
    for model in models:
        assert SECRET not in str(model.tags)
        for version in client.search_model_versions(f"name = '{model.name}'"):
            assert SECRET not in str(version.tags) and SECRET not in str(version.source)

    instance = dg.DagsterInstance.from_config(str(stack.dagster_home))
    events = [*instance.all_logs(ui_run.run_id), *instance.all_logs(ui_run.second_run_id)]
    metadata = [str(e.dagster_event.event_specific_data) for e in events if e.dagster_event is not None]
    assert any("mlflow_run_id" in m for m in metadata)
    assert not [m for m in metadata if SECRET in m]
    assert not [e.user_message for e in events if SECRET in (e.user_message or "")]

    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{stack.settings.s3_port}", region_name="us-east-1",
                      aws_access_key_id="ui-test-key", aws_secret_access_key=SECRET)
    objects = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET) for o in p.get("Contents", [])]
    assert objects
    leaked = [k for k in objects if secret in s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()]
    assert leaked == []
