import os

import pytest

# Tests spawn several ranks on a 2-core machine: keep each process single-threaded unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is a CPU suite (gloo, CPU RSS bounds), also on a machine with a GPU: every engine it makes, in this
# process, its spawned ranks and the torchrun jobs it launches, trains on the CPU ([Note: choosing the device]).
os.environ.setdefault("SHARDTRAIN_DEVICE", "cpu")
# Nothing may be downloaded at test time: Hugging Face models are built from configs with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
