import os
import sys
import time

import pytest

pytest_plugins = ["pytester"]  # tests of this conftest's own hooks run a small suite in a temporary directory

# Tests spawn several ranks on a 2-core machine: keep each process single-threaded unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is a CPU suite (gloo, CPU RSS bounds), also on a machine with a GPU: every engine it makes, in this
# process, its spawned ranks and the torchrun jobs it launches, trains on the CPU ([Note: choosing the device]).
os.environ.setdefault("SHARDTRAIN_DEVICE", "cpu")
# Real DeepSpeed in the tests (the reference of the migration tests) runs on the CPU beside a GPU too.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-compiles its CPU Adam ops (about 100 s on 2 cores) into torch's extension directory. Torch's
# default, ~/.cache/torch_extensions, is shared by every virtual environment of the machine, and its build commands
# name the venv's include paths: a run from another venv (a fresh clone) rewrites them and the next run from this
# one rebuilds (86 s measured in a test's setup). A directory inside this venv keeps one build per venv.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
# Nothing may be downloaded at test time: Hugging Face models are built from configs with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The ranks of most distributed tests build Hugging Face models: import transformers and the modules of the models
# the suite builds most once, in the server the ranks are forked from, instead of once per rank (seconds each here).
_MODELS_THE_RANKS_BUILD = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gpt2", "bert")


def _preload_for_the_ranks() -> None:
    from shardtrain.testing import preload

    preload("transformers", *(f"transformers.models.{name}.modeling_{name}" for name in _MODELS_THE_RANKS_BUILD))


_preload_for_the_ranks()

_DEADLINE_MARGIN_S = 15  # time left for run_distributed to kill its ranks and report before pytest-timeout fires


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's pytest-timeout, less a margin, as the deadline ``run_distributed`` and ``run_ranks`` wait until
    at most ([Note: the caller's deadline] in ``shardtrain.testing``): a longer ``timeout=`` given to them still
    ends with their message naming the ranks still running, not with pytest's stack dump. Module fixtures set up
    for this test count too."""
    from shardtrain.testing import DEADLINE_ENV

    marker = item.get_closest_marker("timeout")
    seconds = float(marker.args[0]) if marker is not None and marker.args else float(item.config.getini("timeout") or 0)
    if seconds > 0:
        os.environ[DEADLINE_ENV] = str(time.time() + max(seconds - _DEADLINE_MARGIN_S, 1.0))
    try:
        yield
    finally:
        os.environ.pop(DEADLINE_ENV, None)


class _GpuTestsLast:
    """Tests marked ``gpu`` are skipped on a machine without CUDA (see :func:`_gpu_tests_train_on_the_gpu`). With
    one, they run after every other test: some set CUDA up in this process, and a process with CUDA set up must not
    fork (the memory planner's search then runs its workers in-process, which a CPU test checks).

    The order is settled after every other plugin's: ``--ff`` and ``--nf`` put failed or new tests first from a
    wrapper of this hook that pytest registers at configuration, after this file. So this is a wrapper too,
    registered after those (:func:`pytest_configure`), hence the outermost."""

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        yield
        import torch  # here, not at the top: OMP_NUM_THREADS is set before torch loads

        marked = [item for item in items if item.get_closest_marker("gpu") is not None]
        if torch.cuda.is_available():
            items[:] = [item for item in items if item.get_closest_marker("gpu") is None] + marked
            return
        skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
        for item in marked:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config.pluginmanager.register(_GpuTestsLast(), "shardtrain-gpu-tests-last")


@pytest.fixture(autouse=True)
def _gpu_tests_train_on_the_gpu(request, monkeypatch):
    """The suite trains on the CPU also where there is a GPU (``SHARDTRAIN_DEVICE=cpu`` above); a test marked
    ``gpu`` is there to train on the GPU, so for it, and the ranks it starts, the setting says so. A GPU machine
    runs these with ``pytest -m gpu`` (docs/benchmarks-gpu.md)."""
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.setenv("SHARDTRAIN_DEVICE", "cuda")


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _rendezvous_stays_in_its_test():
    """A test that sets the rendezvous variables (or calls something that does, such as the DeepSpeed shim's
    ``init_distributed`` with an explicit port) must not hand them to the processes later tests start: they would
    rendezvous on a port that is taken (EADDRINUSE). ``initialize`` without a launcher sets none of them."""
    before = {k: os.environ.get(k) for k in _RENDEZVOUS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
