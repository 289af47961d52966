"""The full curation chain on a synthetic pool: embedding near-dup pruning, cluster balancing,
the report, and byte-identical reruns.

Balancing drops images the pool labels call clean, so the per-filter scores below count
``over_represented`` as kept; they must stay above the thresholds the pHash-only run meets
(tests/integration/test_curate_pool.py), with duplicate recall at least as high.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipelines.curate import curate
from sapiens2.curation import BalanceConfig, CurationConfig, EmbeddingConfig
from tests.integration.test_curate_pool import THRESHOLDS, generated_pool

CONFIG = CurationConfig(workers=1, embedding=EmbeddingConfig(near_dup_cosine=0.93),
                        balance=BalanceConfig(target_size=40, clusters=8, top_clusters=3))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    return generated_pool(tmp_path_factory, n_people=80, seed=11, workers=1)


@pytest.fixture(scope="module")
def curated(pool, tmp_path_factory):
    return curate(pool[0], tmp_path_factory.mktemp("curated"), CONFIG)


def _scores(labels: pd.DataFrame, manifest: pd.DataFrame) -> dict[str, tuple[float, float]]:
    joined = labels.merge(manifest, on="id", validate="one_to_one")
    expected = joined["expected_reason"].fillna("kept")
    got = joined["reason"].fillna("kept").replace("over_represented", "kept")
    scores = {}
    for reason in THRESHOLDS:
        hits = int(((expected == reason) & (got == reason)).sum())
        scores[reason] = (hits / max(1, int((got == reason).sum())), hits / max(1, int((expected == reason).sum())))
    return scores


def test_filters_and_embedding_dedup_agree_with_pool_labels(pool, curated):
    _, labels = pool
    manifest = pd.read_parquet(curated.manifest_path)
    failures = []
    for reason, (precision, recall) in _scores(labels, manifest).items():
        min_precision, min_recall = THRESHOLDS[reason]
        print(f"{reason:13s} precision {precision:.3f} (>= {min_precision})  recall {recall:.3f} (>= {min_recall})")
        if precision < min_precision or recall < min_recall:
            failures.append(f"{reason}: precision {precision:.3f}, recall {recall:.3f}")
    by_pass = manifest.loc[manifest["reason"] == "duplicate", "detail"].str.extract(
        r"\((identical sha256|hamming|embedding cosine)")[0].value_counts()
    print(f"duplicates by pass: {by_pass.to_dict()}")
    assert not failures, failures
    n = len(manifest)
    assert n == curated.n_inputs == sum(curated.status_counts.values())


def test_balance_hits_the_target_and_flattens_clusters(curated):
    manifest = pd.read_parquet(curated.manifest_path)
    sizes = curated.cluster_sizes
    before, after, top = (np.asarray(sizes[k]) for k in ("before", "after", "top_of_leaf"))
    top_before = np.bincount(top, weights=before).astype(int)
    top_after = np.bincount(top, weights=after).astype(int)
    print(f"leaf sizes before {before.tolist()} after {after.tolist()}; "
          f"top before {top_before.tolist()} after {top_after.tolist()}")
    assert curated.status_counts["kept"] == 40 == after.sum()
    assert (after <= before).all() and before.sum() == 40 + curated.reason_counts["over_represented"]
    # Every top cluster gets min(its size, an even share); the spread can only shrink.
    assert top_after.max() - top_after.min() <= max(1, top_before.max() - top_before.min())
    assert (top_after.max() / max(1, top_after.min())) <= (top_before.max() / max(1, top_before.min()))
    kept = manifest[manifest["status"] == "kept"]
    assert kept["cluster"].notna().all() and kept["cluster"].value_counts().sort_index().tolist() == [
        a for a in after.tolist() if a > 0]


def test_report_and_rerun(pool, curated, tmp_path):
    root, _ = pool
    report = curated.report_path.read_text()
    assert "## Cluster balance" in report and "### duplicate" in report
    assert (curated.report_path.parent / "report" / "clusters.png").is_file()
    again = curate(root, tmp_path / "again", CONFIG)
    assert again.manifest_path.read_bytes() == curated.manifest_path.read_bytes()
