import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes each
# small matmul 10x slower. Tests on real models set their own thread count.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _planner_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The planner's measured costs go to a folder of this test run, never the user's cache (set in
    the environment, so the command-line tests' subprocesses use it too)."""
    from specdec.measurements import CACHE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("planner")))
        yield
