"""Loading the Dagster code location imports definitions, not the stacks the steps run on: the
webserver, the daemon and every step process load it, so DeepSpeed and great-expectations are
imported only inside the assets and checks that use them."""

from __future__ import annotations

import subprocess
import sys

from pipelines.common.workspace import PROJECT_ROOT

HEAVY = ("deepspeed", "great_expectations")


def test_the_code_location_loads_without_deepspeed_or_great_expectations() -> None:
    probe = ("import sys, assets.definitions as d; d.defs.resolve_job_def('end_to_end'); "
             f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] in ([], [""]), f"imported at load time: {out.stdout.strip()}"


def test_jobs_that_write_the_workspace_run_one_at_a_time() -> None:
    """The instance's run limits read run tags (op tags never reach them): every job that writes
    the shared workspace or registry carries the tag dagster.yaml and the Helm values limit to 1."""
    import yaml

    from assets.definitions import defs

    dagster_yaml = yaml.safe_load((PROJECT_ROOT / "dagster.yaml").read_text())["concurrency"]["runs"]
    assert dagster_yaml["max_concurrent_runs"] == 1
    (limit,) = dagster_yaml["tag_concurrency_limits"]
    assert limit["limit"] == 1
    for name in ("end_to_end", "promote", "rollback"):
        assert defs.resolve_job_def(name).tags.get(limit["key"]) == limit["value"], name
    assert limit["key"] not in defs.resolve_job_def("filter_shards").tags  # one shard's score file each
