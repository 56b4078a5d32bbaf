"""The worker threads of gloo process groups, as the kernel lists them (``/proc/self/task``; Linux only).

[Note: gloo workers that outlive the engine]
A gloo group runs two worker threads (``pt_gloo_runloop``) that execute its collectives. After a collective's
result is marked complete, so after the caller's ``wait()`` has returned, the worker still drops its own reference to
the work object (``ProcessGroupGloo::runLoop``: ``workInProgress_[i].reset()``). When that is the last reference,
the work's tensors are freed on the worker thread, and a tensor whose Python object was already dropped by Python
has that object released too, which takes the GIL (``c10::TensorImpl::decref_pyobject`` ->
``ConcretePyInterpreterVTable::decref`` -> ``pybind11::gil_scoped_acquire``). If the interpreter is finalizing by
then, CPython 3.11 ends the thread with ``pthread_exit`` (``take_gil`` -> ``PyThread_exit_thread``), whose forced
unwinding reaches a ``noexcept`` destructor (``~AsyncAllgatherWork``) and calls ``std::terminate``: the process dies
with ``terminate called without an active exception`` (SIGABRT) after the script has finished. The 8 core dumps of
a plain gloo script's aborts (docs/reliability.md) all show that stack (one a step further on: the worker got the GIL,
released it in ``THPVariable_clear`` and asked again). It needs the worker to be descheduled between completing the
work and dropping it until the main thread has started finalizing: rare, and more likely on a loaded machine.

Only the destructor of a group joins its workers, when the last reference to it goes (gloo's ``shutdown()`` does
nothing, and ``destroy_process_group`` only removes the group from torch's registries). ``engine.close()`` therefore
drops every reference the engine holds to its groups, and the groups are freed and their workers joined while the
interpreter is whole. A group the engine does not own may outlive it: the default group of a Hugging Face Trainer
is kept by DeepSpeed's ``deepspeed.comm`` (imported by transformers after the group exists, it holds the group as a
default argument of its ``barrier``), so its workers live until the process ends. For those, the last exit hook
(:func:`settle_gloo_workers`) releases the GIL until every remaining worker has been seen waiting for work twice in a
row: a worker late in dropping a work is runnable, or gets the GIL at once while the main thread sleeps.
"""

from __future__ import annotations

import os
import time

WORKER = "pt_gloo_runloop"
_TASKS = "/proc/self/task"


def gloo_workers() -> dict[int, str]:
    """This process's gloo worker threads: thread id -> scheduler state (``R`` running or runnable, ``S`` waiting,
    ...); empty where ``/proc`` is not there."""
    found: dict[int, str] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != WORKER:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        found[int(tid)] = stat[stat.rindex(")") + 2]  # the field after the command name, which may hold spaces
    return found


def settle_gloo_workers(limit_s: float = 2.0, poll_s: float = 0.005) -> bool:
    """Sleep (the GIL released) until every gloo worker thread left has been seen waiting (``S``) in two samples in a
    row, at most ``limit_s``; whether they settled. See [Note: gloo workers that outlive the engine]."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while True:
        workers = gloo_workers()
        quiet = quiet + 1 if all(state == "S" for state in workers.values()) else 0
        if quiet >= 2 or not workers:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
