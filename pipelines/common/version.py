"""DVC workspace operations: the content hashes that version datasets and checkpoints.

The `dvc` CLI runs as `python -m dvc` from the running interpreter, so the venv's DVC (with
dvc-s3) is used whatever PATH says. Outputs produced by a `dvc.yaml` stage are recorded with
`commit_stage`; anything else with `add`. A directory's hash is DVC's `.dir` md5, the value
the platform uses as Dagster data version and MLflow lineage tag.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

REMOTE_NAME = "storage"


def content_md5(path: str | Path) -> str:
    """DVC's hash of the bytes now at `path`: a file's md5, or for a folder the md5 of the JSON
    list of its files' {md5, relpath} sorted by path, plus ".dir" (dvc-data's `Tree.digest`).

    It equals what `dvc.lock` records while the folder is as committed and changes the moment a
    file does, so lineage can name the data a step read rather than the lock file's word.
    """
    path = Path(path)
    if path.is_file():
        return _file_md5(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder to hash")
    entries = sorted(({"md5": _file_md5(f), "relpath": f.relative_to(path).as_posix()}
                      for f in path.rglob("*") if f.is_file()), key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def _file_md5(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


class DvcError(RuntimeError):
    """A dvc command failed; the message carries the command and dvc's stderr."""


class DvcWorkspace:
    """A folder holding `dvc.yaml`/`dvc.lock` and a `.dvc/` directory (git optional)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run `dvc <args>` in the workspace root; raise DvcError on a non-zero exit. Steps that
        finish together (two fine-tunings) queue on DVC's repository lock instead of failing."""
        cmd = [sys.executable, "-m", "dvc", "--wait-for-lock", *args]
        proc = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True)
        if proc.returncode != 0:
            detail = (proc.stderr.strip() or proc.stdout.strip())
            raise DvcError(f"`dvc {' '.join(args)}` failed in {self.root} "
                           f"(exit {proc.returncode}): {detail}")
        return proc

    def _is_git_toplevel(self) -> bool:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=self.root,
                              capture_output=True, text=True)
        return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == self.root

    def ensure_initialised(self, remote_url: str | Path, endpoint_url: str | None = None) -> None:
        """Initialise DVC if needed and make `remote_url` the default remote `storage`.

        `remote_url` is a local directory or `s3://bucket/prefix`; `endpoint_url` points S3 at
        a non-AWS service (MinIO, moto). DVC runs without git when the root is not a git
        repository's top level. Safe to call repeatedly: the remote is overwritten each time.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.root / ".dvc").is_dir():
            self.run("init", *(() if self._is_git_toplevel() else ("--no-scm",)))
        self.run("config", "core.analytics", "false")
        url = str(remote_url)
        if "://" not in url:
            url = str(Path(url).resolve())
        # --local: the machine-specific remote goes to .dvc/config.local (git-ignored), so
        # pointing a checkout at its own storage never dirties the tracked .dvc/config.
        self.run("remote", "add", "--local", "--default", "--force", REMOTE_NAME, url)
        if endpoint_url:
            self.run("remote", "modify", "--local", REMOTE_NAME, "endpointurl", endpoint_url)

    def _relative(self, path: str | Path) -> str:
        p = Path(path)
        if p.is_absolute():
            p = p.resolve().relative_to(self.root)
        return p.as_posix().rstrip("/")

    def _lock(self) -> dict:
        lock = self.root / "dvc.lock"
        if not lock.is_file():
            return {}
        return yaml.safe_load(lock.read_text()) or {}

    def commit_stage(self, stage_name: str) -> dict[str, str]:
        """Record a stage's existing outputs in dvc.lock and the cache; return {out_path: md5}.

        For stages whose command ran outside `dvc repro` (a Dagster asset, a DeepSpeed job).
        """
        self.run("commit", "--force", stage_name)
        stage = self._lock().get("stages", {}).get(stage_name)
        if stage is None:
            raise DvcError(f"stage {stage_name!r} is not in {self.root / 'dvc.lock'} after commit")
        return {out["path"]: out["md5"] for out in stage.get("outs", [])}

    def add(self, path: str | Path) -> str:
        """Track a file or folder that no dvc.yaml stage produces; return its md5."""
        rel = self._relative(path)
        self.run("add", rel)
        meta = yaml.safe_load((self.root / f"{rel}.dvc").read_text())
        return meta["outs"][0]["md5"]

    def push(self, targets: Sequence[str] | None = None) -> None:
        """Upload the cache objects of `targets` (stages or .dvc files; all when None)."""
        self.run("push", "--remote", REMOTE_NAME, *(targets or ()))

    def status(self) -> dict:
        """`dvc status` against the workspace (`local`) and the remote (`cloud`); {} is clean."""
        local = self.run("status", "--json").stdout
        cloud = self.run("status", "--cloud", "--remote", REMOTE_NAME, "--json").stdout
        return {"local": json.loads(local or "{}"), "cloud": json.loads(cloud or "{}")}

    def out_hash(self, path: str | Path) -> str:
        """The md5 recorded for `path` in dvc.lock or in `<path>.dvc` (`<md5>.dir` for folders)."""
        rel = self._relative(path)
        for stage in self._lock().get("stages", {}).values():
            for out in stage.get("outs", []):
                if out["path"].rstrip("/") == rel:
                    return out["md5"]
        dvc_file = self.root / f"{rel}.dvc"
        if dvc_file.is_file():
            return yaml.safe_load(dvc_file.read_text())["outs"][0]["md5"]
        raise KeyError(f"{rel} is not an output in {self.root / 'dvc.lock'} nor tracked by a .dvc file")
