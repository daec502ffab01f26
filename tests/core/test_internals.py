"""Every private name of torch, torchdata, numpy or fsspec that air_core uses still means what it did.

Each test builds the real object and reads its touch through the ``Touch`` (``air_core/internals.py``),
so a release that renames or removes one fails here with the touch's own message, which names what
changed, the installed release and the releases it was checked against.
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, Dataset, get_worker_info

from air_core import internals
from air_core.errors import AirError
from air_core.internals import (
    ITERATOR_BASE_SEED,
    ITERATOR_INDEX_SAMPLER,
    LOADER_ITERATOR,
    PIN_MEMORY,
    S3_CALL,
    STATEFUL_INITIAL_ITER,
    STATEFUL_ITERATOR,
    STORAGE_ID,
    STORAGE_INFO,
    WORKER_NUMPY_SEED,
    Touch,
)
from tests.conftest import REPO
from tests.zygote import python


class _Seeds(Dataset):
    """Each sample: the id of the worker that read it, its torch seed and its numpy key (as seeded).
    Bytes, not a tensor: a worker passes a tensor through a file in /dev/shm, and drops the sample
    where it cannot make one (a full /dev/shm), leaving the loader to wait forever."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[int, int, bytes]:
        info = get_worker_info()
        assert info is not None
        return info.id, info.seed, np.random.get_state()[1].tobytes()


def _workers(n: int) -> dict:
    """A loader's ``n`` workers, forked from a forkserver: this pytest worker's other threads (fsspec's
    loop and executors, an idle writer pool, multiprocessing's resource sharer) may hold a lock when it
    forks, which a worker forked from it then waits for forever (``torch.manual_seed``'s lazy-call lock, a
    module's import lock). Loaders forked from it hung that way in full runs, never in isolation."""
    return {"num_workers": n, "multiprocessing_context": "forkserver"} if n else {"num_workers": 0}


def _seeds_loader() -> DataLoader:
    # a sample that never comes fails the test in a minute, naming the loader, not at pytest-timeout
    return DataLoader(_Seeds(), batch_size=None, timeout=60, **_workers(2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_maps_items_to_the_storage_info_class(tmp_path):
    """A stock ``dcp.save`` records each item as the class ``DcpWriter`` builds, with its three fields."""
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    storage_info = STORAGE_INFO.imported()
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert metadata.storage_data and all(type(v) is storage_info for v in metadata.storage_data.values())
    info = storage_info("__0_0.distcp", 3, 7)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 3, 7)


def test_storage_identity_is_shared_by_views_and_distinct_for_empty_storages():
    base = torch.arange(6.0)
    view = base[2:].view(2, 2)
    empty_a, empty_b = torch.empty(0), torch.empty(0)
    assert STORAGE_ID.get(base.untyped_storage()) == STORAGE_ID.get(view.untyped_storage())
    assert STORAGE_ID.get(base.untyped_storage()) != STORAGE_ID.get(torch.arange(6.0).untyped_storage())
    assert STORAGE_ID.get(empty_a.untyped_storage()) != STORAGE_ID.get(empty_b.untyped_storage())


@pytest.mark.parametrize("workers", [0, 1])
def test_a_persistent_workers_loader_keeps_its_iterator_where_the_touch_reads_and_writes_it(workers):
    loader = DataLoader(list(range(8)), batch_size=2, persistent_workers=workers > 0, **_workers(workers))
    assert LOADER_ITERATOR.get(loader) is None
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    if not workers:  # a new iterator per pass, none kept
        assert LOADER_ITERATOR.get(loader) is None
        return
    assert LOADER_ITERATOR.get(loader) is iterator
    assert iter(loader) is iterator, "persistent workers: every pass reuses the kept iterator"
    iterator._shutdown_workers()
    LOADER_ITERATOR.set(loader, None)  # as Lightning's teardown drops it
    assert LOADER_ITERATOR.get(loader) is None and iter(loader) is not iterator
    LOADER_ITERATOR.get(loader)._shutdown_workers()


_SEEDED = """
import json
from air_core.internals import ITERATOR_BASE_SEED
from tests.core.test_internals import _seeds_loader
iterator = iter(_seeds_loader())
print(json.dumps([ITERATOR_BASE_SEED.get(iterator), {worker: seed for worker, seed, _ in iterator}]))
"""


def test_workers_are_seeded_from_the_iterators_base_seed():
    """In a process of its own, as a training job forks its workers. Forked from this pytest worker, whose
    other threads (moto's server, fsspec's loop and its executors) may hold a lock at that moment that a
    worker then waits for forever (torch.manual_seed's lazy-call lock, a module's import lock), the loader
    hung here three times in full runs, never in isolation."""
    done = subprocess.run(
        [python(), "-c", _SEEDED], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    base, seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"0": base, "1": base + 1}
    assert isinstance(ITERATOR_BASE_SEED.get(iter(DataLoader(list(range(4))))), int), "workers=0 too"


@pytest.mark.parametrize("workers", [0, 1])
def test_an_iterator_reiterates_the_index_sampler_the_touch_sets(workers):
    loader = DataLoader(list(range(8)), batch_size=2, persistent_workers=workers > 0, **_workers(workers))
    iterator = iter(loader)
    assert ITERATOR_INDEX_SAMPLER.get(iterator) is loader.batch_sampler
    list(iterator)
    if workers:  # what TrackedLoader does for one pass of a persistent-workers loader
        ITERATOR_INDEX_SAMPLER.set(iterator, [[6, 7], [0, 1]])
        assert [b.tolist() for b in iter(loader)] == [[6, 7], [0, 1]]
        iterator._shutdown_workers()


def test_pin_memory_returns_a_nested_batch_in_its_structure():
    pin = PIN_MEMORY.imported()
    batch = {"x": torch.ones(2), "y": [torch.zeros(1), "label"], "n": 3}
    if not torch.accelerator.is_available():  # pinning needs an accelerator; the structure is the contract
        batch = {"y": ["label", 1.5], "n": 3}
        assert pin(batch) == batch
        return
    pinned = pin(batch)
    assert pinned["x"].is_pinned() and pinned["y"][0].is_pinned() and pinned["y"][1] == "label"


def test_a_workers_numpy_generator_is_seeded_as_generate_state_says():
    iterator = iter(_seeds_loader())
    base = ITERATOR_BASE_SEED.get(iterator)
    keys = {worker: key for worker, _, key in iterator}
    for worker, key in keys.items():
        expected = np.random.RandomState(WORKER_NUMPY_SEED.imported()(base, worker)).get_state()[1]
        assert np.frombuffer(key, dtype=np.uint32).tolist() == expected.tolist()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_stateful_loader_marks_the_iterator_its_first_state_dict_started(workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(list(range(8)), batch_size=2, **_workers(workers))
    assert STATEFUL_ITERATOR.get(loader) is None and STATEFUL_INITIAL_ITER.get(loader) is False
    loader.state_dict()
    early = STATEFUL_ITERATOR.get(loader)
    assert early is not None and STATEFUL_INITIAL_ITER.get(loader) is True
    # What accelerate_air does to start the first epoch at iter(): drop the early iterator.
    STATEFUL_ITERATOR.set(loader, None)
    STATEFUL_INITIAL_ITER.set(loader, False)
    fresh = iter(loader)
    assert fresh is not early and [b.tolist() for b in fresh] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_s3fs_calls_the_s3_api_with_its_retries_and_credentials(s3_root):
    import s3fs
    from fsspec.asyn import sync

    fs = s3fs.S3FileSystem(**s3_root.storage_options)
    bucket = s3_root.url.removeprefix("s3://").split("/")[0]
    fs.pipe(f"{bucket}/k", b"0123456789")
    response = sync(fs.loop, S3_CALL.get(fs), "get_object", Bucket=bucket, Key="k", Range="bytes=2-5")

    async def body() -> bytes:
        return await response["Body"].read()

    assert sync(fs.loop, body) == b"2345"


def test_every_touch_of_this_module_is_tested_here():
    declared = {name for name, value in vars(internals).items() if isinstance(value, Touch)}
    tested = {
        "STORAGE_INFO",
        "STORAGE_ID",
        "LOADER_ITERATOR",
        "ITERATOR_BASE_SEED",
        "ITERATOR_INDEX_SAMPLER",
        "PIN_MEMORY",
        "WORKER_NUMPY_SEED",
        "STATEFUL_ITERATOR",
        "STATEFUL_INITIAL_ITER",
        "S3_CALL",
    }
    assert declared == tested, "a new touch needs a test in this file"


def test_a_missing_name_raises_air_error_naming_it_the_package_and_the_checked_releases():
    touch = Touch("torch", "DataLoader._gone", "2.13.0", "no public name gives it")
    installed = metadata.version("torch")  # the distribution's (a CUDA build's torch.__version__ adds +cu130)
    with pytest.raises(AirError, match=r"torch .* changed DataLoader\._gone .*'_gone'") as got:
        touch.get(DataLoader(list(range(2))))
    message = str(got.value)
    assert installed in message and "checked against torch 2.13.0" in message
    assert "no public name gives it" in message
    with pytest.raises(AirError, match="_gone"):
        touch.set(DataLoader(list(range(2))), None)
    assert touch.get(object(), None) is None, "a default is returned, not an error"
    gone = Touch("torch", "torch.utils.data._utils.worker._gone", "2.13.0", "it is gone")
    with pytest.raises(AirError, match=r"changed torch\.utils\.data\._utils\.worker\._gone"):
        gone.imported()
