"""The local production-like stack on loopback: S3 (moto server), an MLflow tracking server with
its artifacts on S3, Dagster's webserver and daemon.

    python -m infra.stack up       # start, wait until healthy, write .stack/env
    source .stack/env              # then `make demo`, `sapiens2 ...` run against the stack
    python -m infra.stack status
    python -m infra.stack down     # stops only the processes `up` started

Settings come from `pipelines.common.services` (environment over `infra/stack.env`). Each service runs
in its own process group; its pid, command and log are under the state folder (`.stack/`, or
`$SAPIENS2_STACK_DIR`), so `down` signals exactly those groups and nothing else. `up` fails
with the service's log tail when a port is taken, a process exits, or a health check times out,
and stops whatever it had started.
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
from dataclasses import dataclass
from pathlib import Path

from infra import health
from pipelines.common.services import ServiceSettings, redact
from pipelines.common.workspace import PROJECT_ROOT

BIN = Path(sys.executable).parent


class StackError(RuntimeError):
    """The stack could not start or stop; the message names the service and shows its log."""


@dataclass(frozen=True)
class Service:
    name: str
    argv: list[str]
    port: int | None
    ready: str  # name of the health check in infra.health
    env: tuple[tuple[str, str], ...] = ()  # values kept out of argv (a DSN holds a password; argv is world-readable)

    def log(self, state: Path) -> Path:
        return state / "logs" / f"{self.name}.log"


def state_dir() -> Path:
    return Path(os.environ.get("SAPIENS2_STACK_DIR", PROJECT_ROOT / ".stack")).resolve()


def dagster_home() -> Path:
    """$DAGSTER_HOME, or `.dagster_home/` as the Makefile sets it, holding this project's dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME", PROJECT_ROOT / ".dagster_home")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    link = home / "dagster.yaml"
    if not link.exists():
        link.symlink_to(PROJECT_ROOT / "dagster.yaml")
    return home


def client_env(settings: ServiceSettings) -> dict[str, str]:
    """What a pipeline step (or `make demo`) needs to run against the stack."""
    endpoint = settings.s3_endpoint_url or f"http://{settings.host}:{settings.s3_port}"
    env = settings.with_endpoint(endpoint).aws_env()
    env["MLFLOW_TRACKING_URI"] = f"http://{settings.host}:{settings.mlflow_port}"
    env["SAPIENS2_DVC_REMOTE"] = settings.s3_uri("dvc")
    env["SAPIENS2_CHECKPOINT_STORE"] = settings.s3_uri("checkpoints")  # final weights, verified (pipelines/common/s3.py)
    env["DAGSTER_HOME"] = str(dagster_home())
    return env


def services(settings: ServiceSettings, state: Path) -> list[Service]:
    host = settings.host
    backend = settings.mlflow_db_dsn or f"sqlite:///{state / 'mlflow.db'}"
    code = ["-m", "assets.definitions", "-d", str(PROJECT_ROOT)]
    s3 = [] if settings.s3_endpoint_url else [
        Service("s3", [str(BIN / "moto_server"), "-H", host, "-p", str(settings.s3_port)], settings.s3_port, "s3")]
    return [
        *s3,
        Service("mlflow", [str(BIN / "mlflow"), "server", "--host", host, "--port", str(settings.mlflow_port),
                           "--workers", "1", "--artifacts-destination", settings.s3_uri("mlflow")],
                settings.mlflow_port, "mlflow", env=(("MLFLOW_BACKEND_STORE_URI", backend),)),
        Service("dagster-webserver", [str(BIN / "dagster-webserver"), "-h", host, "-p", str(settings.dagster_port), *code],
                settings.dagster_port, "dagster"),
        Service("dagster-daemon", [str(BIN / "dagster-daemon"), "run", *code], None, "daemon"),
    ]


def _port_free(host: str, port: int) -> bool:
    """Nothing listens on host:port (SO_REUSEADDR, as the servers use: TIME_WAIT doesn't count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 25) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _load_pids(state: Path) -> dict[str, dict]:
    path = state / "pids.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_pids(state: Path, pids: dict[str, dict]) -> None:
    (state / "pids.json").write_text(json.dumps(pids, indent=2))


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None if no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def identity(pid: int) -> dict:
    """What tells the process we started from a later one that reuses its pid: the boot and the
    start time. Recorded beside the pid in `pids.json`."""
    return {"boot_id": _boot_id(), "start_ticks": _start_ticks(pid)}


def _ours(entry: dict) -> bool:
    """True when the recorded leader is alive and is still the process we started (same boot,
    same start time, not a zombie), not a later process that got its pid."""
    pid = entry["pid"]
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z" or entry.get("boot_id") != _boot_id():
        return False
    return _start_ticks(pid) == entry.get("start_ticks")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _our_group(entry: dict) -> bool:
    """Whether the process group recorded in `entry` is still ours to signal. With the leader
    gone, a live group of that id is its children: Linux hands out no pid still in use as a
    group id, so no other process can hold it. After a reboot, or with the pid now held by a
    newer process, the group is someone else's."""
    if entry.get("boot_id") != _boot_id():
        return False
    if _start_ticks(entry["pid"]) is not None:
        return _ours(entry)
    return _group_alive(entry["pid"])


def _stop(entries: list[dict], grace_s: float = 20.0) -> list[dict]:
    """SIGTERM every recorded process group at once, SIGKILL what is left after `grace_s`."""
    live = [e for e in entries if _our_group(e)]
    for entry in live:
        os.killpg(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_group_alive(e["pid"]) for e in live) and time.monotonic() < deadline:
        time.sleep(0.2)
    for entry in live:
        if _group_alive(entry["pid"]):
            os.killpg(entry["pid"], signal.SIGKILL)
    return live


def up(settings: ServiceSettings | None = None, timeout_s: float = 240.0) -> dict[str, str]:
    """Start every service, wait until each is healthy, write `<state>/env`; return that env."""
    settings = settings or ServiceSettings.load()
    state = state_dir()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    running = {name for name, entry in _load_pids(state).items() if _ours(entry)}
    if running:
        raise StackError(f"stack already running in {state} ({', '.join(sorted(running))}); `down` first")
    plan = services(settings, state)
    for svc in plan:
        if svc.port is not None and not _port_free(settings.host, svc.port):
            raise StackError(f"{svc.name}: port {svc.port} on {settings.host} is already in use; stop what holds it "
                             f"(`ss -ltnp 'sport = :{svc.port}'`) or choose another port in infra/stack.env")
    env = client_env(settings)
    proc_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    pids: dict[str, dict] = {}
    try:
        for svc in plan:
            with svc.log(state).open("w") as log:
                proc = subprocess.Popen(svc.argv, stdout=log, stderr=subprocess.STDOUT, env={**proc_env, **dict(svc.env)},
                                        cwd=PROJECT_ROOT, start_new_session=True)
            pids[svc.name] = {"pid": proc.pid, **identity(proc.pid), "argv": svc.argv, "port": svc.port,
                              "log": str(svc.log(state))}
            _save_pids(state, pids)
            _wait_ready(svc, proc, settings, state, time.monotonic() + timeout_s)
            print(f"  {svc.name:18s} pid {proc.pid:<7d} ready" + (f" on {settings.host}:{svc.port}" if svc.port else ""),
                  flush=True)
    except BaseException:
        _stop(list(pids.values()))
        _save_pids(state, {})
        raise
    _write_env(state / "env", env)
    return env


def _wait_ready(svc: Service, proc: subprocess.Popen, settings: ServiceSettings, state: Path, deadline: float) -> None:
    check = health.CHECKS[svc.ready]
    last = "not checked yet"
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise StackError(f"{svc.name} exited with status {code} while starting; last lines of "
                             f"{svc.log(state)}:\n{_tail(svc.log(state))}")
        ok, last = check(settings)
        if ok:
            return
        time.sleep(1.0)
    raise StackError(f"{svc.name} not healthy after its start timeout ({last}); last lines of "
                     f"{svc.log(state)}:\n{_tail(svc.log(state))}")


def _write_env(path: Path, env: dict[str, str]) -> None:
    """`export` lines to `source`; mode 0600 because the file may hold credentials."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text("".join(f"export {k}='{v}'\n" for k, v in sorted(env.items())))


def down() -> list[str]:
    """Stop the process groups `up` recorded, newest first; return the names stopped."""
    state = state_dir()
    pids = _load_pids(state)
    stopped = {entry["pid"] for entry in _stop(list(pids.values()))}
    if pids:
        _save_pids(state, {})
    return [name for name, entry in pids.items() if entry["pid"] in stopped]


def status(settings: ServiceSettings | None = None) -> dict[str, str]:
    settings = settings or ServiceSettings.load()
    out = {}
    for svc in services(settings, state_dir()):
        entry = _load_pids(state_dir()).get(svc.name)
        if entry is None or not _ours(entry):
            out[svc.name] = "stopped"
            continue
        ok, detail = health.CHECKS[svc.ready](settings)
        out[svc.name] = f"pid {entry['pid']}, {'healthy' if ok else 'unhealthy: ' + detail}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds each service may take to get healthy")
    args = parser.parse_args(argv)
    settings = ServiceSettings.load()
    try:
        if args.command == "up":
            print(f"starting the stack (state and logs in {state_dir()})", flush=True)
            env = up(settings, args.timeout)
            print("\n".join(f"  {k}={v}" for k, v in sorted(redact(env).items())))
            print(f"MLflow  http://{settings.host}:{settings.mlflow_port}\n"
                  f"Dagster http://{settings.host}:{settings.dagster_port}\n"
                  f"Run against it:  source {state_dir() / 'env'} && make demo")
        elif args.command == "down":
            stopped = down()
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
        elif args.command == "status":
            for name, line in status(settings).items():
                print(f"  {name:18s} {line}")
        else:
            print("".join(f"export {k}='{v}'\n" for k, v in sorted(client_env(settings).items())), end="")
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
