"""A mutex in the MLflow registry itself, so alias moves on one model are serialised across
processes and machines (Dagster runs, the CLI) with no extra service.

MLflow has no compare-and-set on aliases, but creating a registered model is atomic: the store's
unique name constraint (SQLite, PostgreSQL, or a tracking server in front of them) lets exactly
one of several concurrent `create_registered_model` calls succeed. The lock is the registered
model `<name>.lock`, deleted on release by the holding that took it (a token in its tags; MLflow
has no conditional delete, so only a break-and-retake between the check and the delete is left);
one older than `stale_s` (its holder died) is broken.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode

LOCK_SUFFIX = ".lock"
log = logging.getLogger(__name__)


class RegistryLockTimeout(RuntimeError):
    """Another holder kept the lock longer than this caller was willing to wait."""


def _is(exc: MlflowException, code: int) -> bool:
    return exc.error_code == ErrorCode.Name(code)


@contextmanager
def registry_lock(client: MlflowClient, name: str, holder: str, timeout_s: float = 120.0,
                  stale_s: float = 900.0) -> Iterator[None]:
    """Hold the lock of registered model `name` for the body of the `with` block."""
    lock = f"{name}{LOCK_SUFFIX}"
    token = uuid.uuid4().hex  # this holding: a lock broken as stale and retaken by another is not ours
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.create_registered_model(lock, tags={"holder": holder, "since": f"{time.time():.3f}", "token": token},
                                           description=f"promotion lock of {name}; held by {holder}")
            break
        except MlflowException as exc:
            if not _is(exc, RESOURCE_ALREADY_EXISTS):
                raise
        try:
            current = client.get_registered_model(lock)
        except MlflowException as exc:
            if _is(exc, RESOURCE_DOES_NOT_EXIST):
                continue  # released between our create and our look
            raise
        since = float(current.tags.get("since", "0"))
        if time.time() - since > stale_s:
            client.delete_registered_model(lock)
            continue
        if time.monotonic() > deadline:
            raise RegistryLockTimeout(f"{name} is locked by {current.tags.get('holder')!r} since "
                                      f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(since))} UTC")
        time.sleep(0.1 + 0.2 * random.random())
    try:
        yield
    finally:
        _release(client, lock, token)


def _release(client: MlflowClient, lock: str, token: str) -> None:
    """Delete the lock only while it is still this holding's."""
    try:
        current = client.get_registered_model(lock)
    except MlflowException as exc:
        if _is(exc, RESOURCE_DOES_NOT_EXIST):
            log.warning("%s was already gone at release (broken as stale?)", lock)
            return
        raise
    if current.tags.get("token") != token:
        log.warning("%s is now held by %r: not releasing it", lock, current.tags.get("holder"))
        return
    client.delete_registered_model(lock)
