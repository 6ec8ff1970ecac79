"""Tests run offline: nothing is downloaded from the Hub. Every test starts from the same global RNG state."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DISABLE_TQDM", "1")
# Under pytest-xdist (`-n N`, pyproject's addopts) each worker, and what it starts, gets its share of the cores, and a
# waiting OpenMP thread sleeps: N processes each spinning OpenMP threads over every core run a test up to 50x slower.
# A test that sets torch's threads (e.g. a command's --threads default) leaves them set; each test starts at the share.
WORKER_THREADS = None
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    WORKER_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "numerics: compares two code paths whose rounding depends on the CPU's kernels (fp32 paths, int8, "
        "packed linears, fused attention); `.ci/run` runs these once more under other kernels (`-m numerics`)")


@pytest.fixture(autouse=True)
def seed_rng():
    """A model built in a test draws its initial weights from the global RNG; seeding it per test makes them (and
    the weights `fitted` trains from them) independent of which tests ran before, e.g. under `-k` or one file.
    Module-scoped fixtures are built before this runs and seed themselves."""
    torch.manual_seed(0)
    if WORKER_THREADS is not None:
        torch.set_num_threads(WORKER_THREADS)


@pytest.fixture
def one_thread():
    """One torch thread for the test (bit-identical runs in forked children; tiny models run faster on one thread,
    much faster when other processes share the cores); used with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
