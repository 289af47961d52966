"""Loading the Dagster code location imports definitions, not the stacks the steps run on: the
webserver, the daemon and every step process load it, so DeepSpeed and great-expectations are
imported only inside the assets and checks that use them."""

from __future__ import annotations

import subprocess
import sys

from pipelines.workspace import PROJECT_ROOT

HEAVY = ("deepspeed", "great_expectations")


def test_the_code_location_loads_without_deepspeed_or_great_expectations() -> None:
    probe = ("import sys, assets.definitions as d; d.defs.resolve_job_def('end_to_end'); "
             f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] in ([], [""]), f"imported at load time: {out.stdout.strip()}"
