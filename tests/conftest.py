"""Fixtures shared by test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

# One intra-op thread per process, here and in every process a test starts (they inherit the environment):
# the reference machine has 2 cores, shared by two pytest workers (`make test` runs `pytest -n 2`), the
# processes their tests start, and MoC's snapshot and persist threads. A second OpenMP thread spinning
# against them made a step up to 5x slower (45 s vs 8 s for
# test_snapshot_every_step_is_taken_timed_and_committed on a loaded machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import xdist  # noqa: E402
from quick_bench import BenchRun, run_quick_bench  # noqa: E402

from moc_lightning.tools.chaos.s3_proxy import S3FaultProxy  # noqa: E402
from moc_lightning.tools.chaos.s3_server import S3Server, running_s3_server  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first


def pytest_configure(config: pytest.Config) -> None:
    """Under ``--dist loadgroup`` pytest-xdist (up to 3.8) sends a group to one worker by suffixing the id of every
    test with an ``xdist_group`` mark; from pytest 9.2 on it sets an attribute that pytest no longer reads, so every
    group silently splits: the expensive fixtures (the quick benchmark, the 4-rank HSDP checkpoints) ran once per
    worker and the suite grew by minutes. Stop before collecting instead."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    if _release(pytest.__version__) >= (9, 2) and _release(xdist.__version__) <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: --dist loadgroup would not group the "
            "tests marked xdist_group; install the pinned versions (requirements/constraints.txt, `make setup`)"
        )


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


@pytest.fixture(scope="session")
def quick_bench(tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    """The quick benchmark, run once per session: the bench test checks it, the notebook test plots it."""
    return run_quick_bench(tmp_path_factory.mktemp("quick_bench"))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A live S3-protocol server (moto) for this test process, with the AWS environment pointed at it."""
    with running_s3_server() as server:
        yield server


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[S3FaultProxy]:
    """A fault proxy in front of this process's S3 server, with no rule yet (``tests/test_s3_faults.py``)."""
    proxy = S3FaultProxy(s3_server.endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty``/``empty_like`` return memory filled with NaN (integers: -1, booleans: True), as uninitialised
    memory may be: a tensor allocated uninitialised and not then written wholly shows it, whatever the allocator reuses."""

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            return tensor.fill_(float("nan"))
        return tensor.fill_(True if tensor.dtype == torch.bool else -1)

    for name in ("empty", "empty_like"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, _real=real, **kwargs: poison(_real(*args, **kwargs)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``cuda(gpus=n)`` is skipped, with the reason, where fewer than ``n`` (default 1) CUDA devices are
    present; ``make gpu-check`` runs every one of them on a GPU node."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        mark = item.get_closest_marker("cuda")
        if mark is None:
            continue
        needed = mark.kwargs.get("gpus", 1)
        if found < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s), found {found} (make gpu-check runs it)"))
