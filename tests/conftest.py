import os

# Tests spawn several ranks on a 2-core machine: keep each process single-threaded unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing may be downloaded at test time: Hugging Face models are built from configs with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
