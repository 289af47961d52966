"""`sapiens2 demo`: materialise the whole graph on the embedded defaults, then say where to look.

The run goes into the Dagster instance under `$DAGSTER_HOME` (default `.dagster_home/`), so the
Dagster UI shows it afterwards as a run of the `end_to_end` job. It runs with the job's own
multiprocess executor, as "Materialize all" in the UI does: two training programs at a time (the
`training` pool), step processes forked from one that imported the code location once; the heavy
steps run as separate programs through Dagster Pipes.
"""


import argparse
import os
import sys
import time

import dagster as dg
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipelines.common import tracking
from pipelines.common.config import TASK_NAMES, load_config
from pipelines.common.model_registry import Production
from pipelines.common.workspace import PROJECT_ROOT, Workspace


def end_to_end_job() -> dg.JobDefinition:
    from assets.definitions import defs

    return defs.resolve_job_def("end_to_end")


def _instance() -> dg.DagsterInstance:
    home = os.environ.setdefault("DAGSTER_HOME", str(PROJECT_ROOT / ".dagster_home"))
    os.makedirs(home, exist_ok=True)
    link = os.path.join(home, "dagster.yaml")
    if not os.path.exists(link):
        os.symlink(PROJECT_ROOT / "dagster.yaml", link)
    return dg.DagsterInstance.get()


def champions(ws: Workspace) -> list[tuple[str, str]]:
    uri = tracking.tracking_uri_for(ws.root)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    prefix = load_config(ws.params_file).registry.model_prefix
    out = []
    for task in TASK_NAMES:
        production = Production.for_model(f"{prefix}-{task}", client)
        name = production.name
        try:
            version = production.client.get_model_version_by_alias(name, "champion").version
        except MlflowException:
            out.append((f"models:/{name}@champion", "none: no version has passed the gate"))
            continue
        out.append((f"models:/{name}@champion", f"version {version}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 demo", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    ws = Workspace.from_env()
    started = time.perf_counter()
    with _instance() as instance:
        result = dg.execute_job(dg.reconstructable(end_to_end_job), instance=instance, raise_on_error=False)
    minutes = (time.perf_counter() - started) / 60
    if not result.success:
        print(f"\nThe end-to-end run {result.run_id} failed after {minutes:.1f} min; see `make dagster` for its logs.", file=sys.stderr)
        return 1
    print(f"\nEnd-to-end run {result.run_id} succeeded in {minutes:.1f} min.\n")
    print("Evaluation on the held-out split:\n")
    print((ws.eval_dir / "table.md").read_text())
    print("Champion models:")
    for uri, version in champions(ws):
        print(f"  {uri}  ({version})")
    print("\nWhere to look:")
    print("  Dagster UI:  make dagster     -> http://127.0.0.1:3000")
    print("  MLflow UI:   make mlflow-ui   -> http://127.0.0.1:5000")
    print(f"  DVC:         .venv/bin/dvc status && ls {ws.dvc_remote}")
    return 0
