import os

# Tests spawn several ranks on a 2-core machine: keep each process single-threaded unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is a CPU suite (gloo, CPU RSS bounds), also on a machine with a GPU: every engine it makes, in this
# process, its spawned ranks and the torchrun jobs it launches, trains on the CPU ([Note: choosing the device]).
os.environ.setdefault("SHARDTRAIN_DEVICE", "cpu")
# Nothing may be downloaded at test time: Hugging Face models are built from configs with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
