import os

# Tests spawn several ranks on a 2-core machine: keep each process single-threaded unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
