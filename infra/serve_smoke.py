"""Serving smoke test: each task's production champion behind `mlflow models serve` answers one image.

    python -m infra.serve_smoke                  # every task, against $MLFLOW_TRACKING_URI (or the workspace store)
    python -m infra.serve_smoke --tasks pose seg

For each task the champion `models:/<prefix>-<task>-production@champion` (or the same name in
`$SAPIENS2_PRODUCTION_REGISTRY_URI`) is served with the local env manager on 127.0.0.1 and a free
port; once `/ping` answers, one synthetic person image goes to `/invocations` as
`{"inputs": [[[[r, g, b], ...]]]}` (uint8, (N, H, W, 3), any size), and the answer is checked against
the task's output contract (`pipelines.common.serving`) and the shape the model's signature declares.
Each server runs in its own process group, stopped by pid when its check is done.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
import numpy as np
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipelines.common.config import TASK_NAMES, load_config
from pipelines.common.model_registry import CHAMPION, Production
from pipelines.common.tracking import tracking_uri_for
from pipelines.common.workspace import Workspace
from sapiens2.data.synth.person import render_person

BIN = Path(sys.executable).parent
NUM_SEG_CLASSES = 29


class ServeError(RuntimeError):
    """A served model did not start or answered outside its task's output contract."""


def champion(task: str, workspace: Workspace | None = None) -> tuple[str, str]:
    """(model URI of the task's production champion, the tracking URI of its registry)."""
    ws = workspace or Workspace.from_env()
    config = load_config(ws.params_file if ws.params_file.is_file() else None)
    dev_uri = tracking_uri_for(ws.root)
    production = Production.for_model(config.model_name(task), MlflowClient(tracking_uri=dev_uri, registry_uri=dev_uri))
    return f"models:/{production.name}@{CHAMPION}", production.client.tracking_uri


def request_image(height: int = 160, width: int = 120, seed: int = 0) -> np.ndarray:
    """One synthetic person, (H, W, 3) uint8 RGB; deliberately not the model's input size."""
    return render_person(np.random.default_rng(seed), height, width).image


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal is still a member
        return True
    return True


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group (mlflow, uvicorn and its workers); SIGKILL what is left after
    `grace_s`. Returns only once every member has exited: the mlflow CLI exits before uvicorn lets go of
    the port, so waiting on the CLI alone leaves the port listening for a moment."""
    pgid = proc.pid  # start_new_session=True: the CLI leads its own group
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        proc.poll()  # reap the CLI so it does not linger as a zombie member
        if not _group_alive(pgid):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10.0
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)


@contextmanager
def served(model_uri: str, tracking_uri: str, log: Path, host: str = "127.0.0.1", port: int | None = None,
           timeout_s: float = 300.0) -> Iterator[str]:
    """Run `mlflow models serve` for `model_uri` until /ping answers; yield its base URL; stop it by pid."""
    port = port or free_port(host)
    argv = [str(BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local",
            "-h", host, "-p", str(port), "-w", "1"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri,
                                     # mlflow execs `uvicorn` by name: find it in this venv even when
                                     # the venv is not activated (make test calls .venv/bin/pytest).
                                     "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    base = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ServeError(f"`mlflow models serve -m {model_uri}` exited with status {proc.returncode}; "
                                 f"last lines of {log}:\n{_tail(log)}")
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServeError(f"{model_uri} not answering {base}/ping after {timeout_s:.0f} s; last lines of "
                                 f"{log}:\n{_tail(log)}")
            time.sleep(1.0)
        yield base
    finally:
        _stop(proc)


def invoke(base_url: str, images: np.ndarray, timeout_s: float = 120.0) -> np.ndarray:
    """POST uint8 images (N, H, W, 3) to /invocations as MLflow's `inputs` JSON; the predictions array."""
    body = json.dumps({"inputs": images.tolist()}).encode()
    request = urllib.request.Request(f"{base_url}/invocations", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return np.asarray(json.loads(resp.read())["predictions"])
    except urllib.error.HTTPError as exc:
        raise ServeError(f"{base_url}/invocations -> {exc.code}: {exc.read()[:2000].decode(errors='replace')}") from exc


def declared_output_shape(model_uri: str) -> tuple[int, ...]:
    """The output tensor shape of the model's signature (batch axis -1)."""
    signature = mlflow.models.get_model_info(model_uri).signature
    if signature is None or signature.outputs is None:
        raise ServeError(f"{model_uri} was logged without an output signature")
    return tuple(signature.outputs.inputs[0].shape)


def check_output(task: str, output: np.ndarray, images: np.ndarray, declared: tuple[int, ...]) -> str:
    """Raise ServeError unless `output` is what `task` returns for `images`; a one-line summary otherwise."""
    expected = (len(images), *declared[1:])
    if output.shape != expected:
        raise ServeError(f"{task}: output shape {output.shape}, expected {expected} (signature {declared})")
    if not np.isfinite(output).all():
        raise ServeError(f"{task}: output has non-finite values")
    height, width = images.shape[1:3]
    if task == "pose":
        xy = output[..., :2]
        if not ((xy[..., 0] >= 0) & (xy[..., 0] <= width) & (xy[..., 1] >= 0) & (xy[..., 1] <= height)).all():
            raise ServeError(f"pose: keypoints outside the {width}x{height} request image")
        return f"{output.shape[1]} keypoints, mean score {output[..., 2].mean():.3f}"
    if task == "seg":
        if not (np.equal(np.round(output), output).all() and 0 <= output.min() and output.max() < NUM_SEG_CLASSES):
            raise ServeError(f"seg: class ids outside 0..{NUM_SEG_CLASSES - 1}")
        return f"{len(np.unique(output))} classes present"
    if output.shape[-1] != 3:
        raise ServeError(f"{task}: expected 3 channels, got {output.shape[-1]}")
    if task == "normal" and not np.allclose(np.linalg.norm(output, axis=-1), 1.0, atol=1e-3):
        raise ServeError("normal: vectors are not unit length")
    if task == "albedo" and not (0.0 <= output.min() and output.max() <= 1.0):
        raise ServeError("albedo: values outside [0, 1]")
    return f"range [{output.min():.3g}, {output.max():.3g}]"


def smoke_task(task: str, log_dir: Path, image: np.ndarray | None = None, workspace: Workspace | None = None,
               timeout_s: float = 300.0) -> tuple[np.ndarray, str]:
    """Serve `task`'s champion, send one image, check the answer; (output, summary)."""
    model_uri, tracking_uri = champion(task, workspace)
    mlflow.set_tracking_uri(tracking_uri)
    images = (request_image() if image is None else image)[None]
    with served(model_uri, tracking_uri, log_dir / f"serve-{task}.log", timeout_s=timeout_s) as base:
        output = invoke(base, images)
    return output, check_output(task, output, images, declared_output_shape(model_uri))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.serve_smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASK_NAMES, default=list(TASK_NAMES))
    parser.add_argument("--logs", type=Path, default=Path(".stack/logs"), help="folder for each server's log")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a server may take to answer /ping")
    args = parser.parse_args(argv)
    failed = []
    for task in args.tasks:
        started = time.monotonic()
        try:
            output, summary = smoke_task(task, args.logs, timeout_s=args.timeout)
        except (ServeError, MlflowException) as exc:
            failed.append(task)
            print(f"{task:9s} FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"{task:9s} ok   {tuple(output.shape)}  {summary}  ({time.monotonic() - started:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
