import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes each
# small matmul 10x slower. Tests on real models set their own thread count (helpers.THREADS).
torch.set_num_threads(1)


def _share_the_cpus() -> None:
    """Under pytest-xdist, give each worker its own share of the CPUs (worker i of n on the i-th
    slice). Two workers that each start two spinning llama.cpp or kernel threads on two cores run
    2.3x slower than two one-thread workers (measured: 0.49 s against 0.21 s per SmolLM2 generation);
    pinned, everything a worker starts -- the kernel's and llama.cpp's default thread count (the CPUs
    this process may run on), the command-line tests' subprocesses, llama-server (LLAMA_ARG_THREADS)
    -- sees its own share."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or workers < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    index, share = int(worker.removeprefix("gw")), max(1, len(cpus) // workers)
    mine = cpus[index * share:(index + 1) * share] or [cpus[index % len(cpus)]]
    os.sched_setaffinity(0, mine)
    os.environ["LLAMA_ARG_THREADS"] = str(len(mine))


_share_the_cpus()


@pytest.fixture(autouse=True, scope="session")
def _planner_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The planner's measured costs go to a folder of this test run, never the user's cache (set in
    the environment, so the command-line tests' subprocesses use it too)."""
    from specdec.measurements import CACHE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("planner")))
        yield


# Files whose module fixtures cost seconds to minutes (bench runs against llama-server, real models
# loaded for a whole file): under `--dist loadgroup` each runs on one worker, so the fixture is built
# once; every other test goes to whichever worker is free.
ONE_WORKER = {"test_bench_llamacpp.py", "test_bench_extract.py", "test_constraints.py", "test_kernel_library.py",
              "test_benchmark_scripts.py", "test_engine_serving.py", "test_server_page.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
