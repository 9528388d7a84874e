"""Loading versions for serving: the record store over HTTP equals the reference, damage is
refused at the level of checking asked for, and a swapped-out version's maps close when the
last request holding it lets go."""

from __future__ import annotations

import asyncio
import gc
import shutil
import weakref
from pathlib import Path
from urllib.parse import quote

import pytest

from app.core.errors import VersionRejected
from app.core.metrics import Metrics
from app.services.threads import WorkerPools
from app.services.versions import VersionManager, open_checked
from indexer.store import artifact
from indexer.store.version import LoadedVersion
from tests.app.conftest import build_index, records_v, running, settings_for
from tests.indexer.test_recordstore import DAMAGE, STORE_FILES, built, reference_records

__all__ = ["built"]  # a module-scoped fixture shared with the indexer's tests


def test_records_over_http_equal_the_reference(built) -> None:
    root, source, rows = built
    version = LoadedVersion(artifact.current_version_dir(root))
    ref = {r["id"]: r for r in reference_records(source, version.names)}
    with running(settings_for(root)) as client:
        for rid in list(ref)[:40]:
            r = client.get(f"/v1/records/{quote(rid, safe='')}")
            assert r.status_code == 200, r.text
            assert r.json() == {**ref[rid], "index_version": version.version}
        hits = client.post("/v1/search", json={"query": {"a": rows[3]["a"]}, "k": 5}).json()
        assert len(hits["results"]) == 5
        for hit in hits["results"]:
            assert hit["payload"] == ref[hit["id"]]["payload"]


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("name", STORE_FILES)
def test_a_damaged_store_is_refused_by_a_full_load(built, tmp_path, damage, name) -> None:
    root, _, _ = built
    vdir = tmp_path / artifact.current_version_dir(root).name
    shutil.copytree(artifact.current_version_dir(root), vdir)
    DAMAGE[damage](vdir / "records" / name)
    with pytest.raises(VersionRejected, match=r"failed verification|cannot be opened"):
        open_checked(vdir, "full")
    # A quick load reads sizes and checksums files up to 1 MiB: these are all small here.
    with pytest.raises(VersionRejected):
        open_checked(vdir, "quick")
    # Nothing checked: opening still compares the arrays' shapes and blob sizes (and the last
    # offset with its blob), so those are refused; other same-size changes go unseen, which is
    # what "off" means.
    if damage == "truncated" or name.endswith("offsets.npy"):
        with pytest.raises(VersionRejected, match="cannot be opened"):
            open_checked(vdir, "off")
    else:
        assert open_checked(vdir, "off").version == vdir.name


def mapped_paths() -> str:
    return Path("/proc/self/maps").read_text()


def publish_small(root: Path, model_dir: Path, tmp_path: Path, tag: str) -> str:
    """A version of 60 vector records tagged `tag`, published under `root`; its id."""
    return build_index(root, model_dir, records_v(tag, n=60), tmp_path)


def test_a_swapped_out_version_is_unmapped_when_its_last_holder_lets_go(
    tmp_path: Path, vector_index
) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    v1 = publish_small(root, model_dir, tmp_path, "v1")

    async def main() -> None:
        pools = WorkerPools(1, 1)
        vm = VersionManager(settings_for(root), Metrics(), pools)
        assert await vm.refresh()
        held = vm.current  # what a request in flight holds
        assert held is not None and held.version == v1
        v2 = publish_small(root, model_dir, tmp_path, "v2")
        assert await vm.refresh() and vm.current is not None and vm.current.version == v2
        v1_dir = str(artifact.version_dir(root, v1))
        assert v1_dir in mapped_paths()  # both mapped during the swap
        del held
        gc.collect()
        assert v1_dir not in mapped_paths()
        assert str(artifact.version_dir(root, v2)) in mapped_paths()
        pools.shutdown()

    asyncio.run(main())


def test_a_served_heap_is_frozen_and_a_swap_lets_the_version_it_retires_be_collected(
    tmp_path: Path, vector_index
) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    v1 = publish_small(root, model_dir, tmp_path, "v1")

    async def main() -> None:
        pools = WorkerPools(1, 1)
        vm = VersionManager(settings_for(root, request_timeout_s=0.5), Metrics(), pools)
        try:
            await vm.start()
            first = vm.current
            assert first is not None and first.version == v1
            assert gc.get_freeze_count() > 0  # what the version holds is out of the scans
            # The retired version sits in a cycle that was frozen: only a collection after a
            # thaw can free it.
            first.cycle = first  # type: ignore[attr-defined]
            vm.heap.settle_in(0.0)
            assert vm.heap.settle_if_due()
            retired = weakref.ref(first)
            del first
            v2 = publish_small(root, model_dir, tmp_path, "v2")
            assert await vm.refresh() and vm.current is not None and vm.current.version == v2
            assert gc.get_freeze_count() == 0  # thawed at the swap
            assert not vm.heap.settle_if_due()  # requests on v1 may run until the deadline
            await asyncio.sleep(0.6)
            assert vm.heap.settle_if_due()
            assert retired() is None and gc.get_freeze_count() > 0
        finally:
            vm.heap.thaw()
            pools.shutdown()

    asyncio.run(main())
    assert gc.get_freeze_count() == 0


def test_a_worker_that_stops_leaves_nothing_frozen(tmp_path: Path, vector_index) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    publish_small(root, model_dir, tmp_path, "v1")
    with running(settings_for(root)) as client:
        assert client.get("/readyz").status_code == 200
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
