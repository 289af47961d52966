"""The raw pool fetched from an S3 prefix (moto server on loopback) instead of rendered: the
download is checked and stays inside its folder, curation keeps the fetched people with their
labels, and the `raw_pool` asset records where the pool came from."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from assets.curation import raw_pool
from assets.resources import DvcResource, PlatformResource
from pipelines.common import s3 as s3mod
from pipelines.curate import curate
from pipelines.synth import fetch_raw_pool
from pipelines.common.services import ServiceSettings
from sapiens2.curation.config import CurationConfig
from sapiens2.data.synth import generate_pool
from tests.conftest import SMALL_RECIPE, make_workspace
from tests.integration.test_s3_upload import Moto

BUCKET = "raw-pools"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pool")
    generate_pool(root, n_people=10, seed=3, height=128, width=96, workers=1, progress=False)
    return root


@pytest.fixture()
def endpoint(monkeypatch: pytest.MonkeyPatch, pool: Path):
    """A moto S3 server holding `pool` under s3://raw-pools/web/batch-1/; its settings in the env."""
    moto = Moto()
    moto.start()
    env = {"SAPIENS2_S3_ENDPOINT_URL": f"http://127.0.0.1:{moto.port}", "AWS_ACCESS_KEY_ID": "raw-key",
           "AWS_SECRET_ACCESS_KEY": "raw-secret", "AWS_DEFAULT_REGION": "us-east-1", "SAPIENS2_S3_BUCKET": BUCKET,
           "SAPIENS2_S3_PREFIX": ""}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = ServiceSettings.load()
    s3 = s3mod.client(settings)
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted(pool.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"web/batch-1/{path.relative_to(pool).as_posix()}")
    yield settings, s3
    moto.stop()


def test_fetch_from_s3_prefix_then_curate(endpoint, pool: Path, tmp_path: Path) -> None:
    _, s3 = endpoint
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "stale.png").write_bytes(b"from an earlier pool")
    count = fetch_raw_pool(f"s3://{BUCKET}/web/batch-1", raw)
    source_images = sorted(p.name for p in (pool / "images").iterdir())
    assert count == len(source_images) and sorted(p.name for p in (raw / "images").iterdir()) == source_images
    assert not (raw / "stale.png").exists() and not list(tmp_path.glob(".raw.fetching"))
    for name in ("labels", "pool_labels.parquet"):
        assert (raw / name).exists()
    assert (raw / "images" / source_images[0]).read_bytes() == (pool / "images" / source_images[0]).read_bytes()

    summary = curate(raw, tmp_path / "curated", CurationConfig(workers=1))
    assert summary.status_counts.get("kept", 0) >= 5
    assert len(list((tmp_path / "curated" / "labels").glob("*.npz"))) >= 5

    # A flat prefix (no images/ folder) is all images.
    s3.upload_file(str(pool / "images" / source_images[0]), BUCKET, f"flat/{source_images[0]}")
    assert fetch_raw_pool(f"s3://{BUCKET}/flat", tmp_path / "flat") == 1
    assert (tmp_path / "flat" / "images" / source_images[0]).is_file()


def test_bad_sources_are_refused_and_nothing_is_replaced(endpoint, tmp_path: Path) -> None:
    _, s3 = endpoint
    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    (raw / "images" / "kept.png").write_bytes(b"the previous pool")
    with pytest.raises(FileNotFoundError, match="no objects under this prefix"):
        fetch_raw_pool(f"s3://{BUCKET}/nothing-here", raw)
    s3.put_object(Bucket=BUCKET, Key="evil/../../escape.png", Body=b"x")
    with pytest.raises(ValueError, match="leaves the destination folder"):
        fetch_raw_pool(f"s3://{BUCKET}/evil", raw)
    with pytest.raises(FileNotFoundError, match="neither an s3:// URI nor a folder"):
        fetch_raw_pool(str(tmp_path / "absent"), raw)
    with pytest.raises(ValueError, match="expected s3://<bucket>"):
        s3mod.split_uri("s3:///no-bucket")
    assert (raw / "images" / "kept.png").read_bytes() == b"the previous pool"
    assert not (tmp_path.parent / "escape.png").exists()


def test_raw_pool_asset_reads_the_configured_prefix(endpoint, pool: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ws = make_workspace(tmp_path / "ws", {**SMALL_RECIPE, "raw_source": f"s3://{BUCKET}/web/batch-1"})
    monkeypatch.setenv("SAPIENS2_WORKSPACE", str(ws))
    monkeypatch.setenv("SAPIENS2_DVC_REMOTE", str(tmp_path / "dvc-remote"))
    result = dg.materialize([raw_pool], resources={"platform": PlatformResource(), "dvc": DvcResource()})
    assert result.success
    meta = result.asset_materializations_for_node("raw_pool")[0].metadata
    assert meta["source"].value == f"s3://{BUCKET}/web/batch-1"
    assert meta["images"].value == len(list((pool / "images").iterdir()))
    assert len(meta["dvc_md5"].value) > 10
    assert sorted(p.name for p in (ws / "data" / "raw" / "images").iterdir()) == sorted(
        p.name for p in (pool / "images").iterdir())
