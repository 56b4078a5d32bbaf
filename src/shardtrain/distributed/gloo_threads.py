"""The worker threads of gloo process groups, as the kernel lists them (``/proc/self/task``; Linux only).

[Note: gloo workers that outlive the engine]
A gloo group's two workers (``pt_gloo_runloop``) drop their own reference to a work object after the caller's
``wait()`` has returned. If that is the last reference, freeing its tensors releases Python objects, which takes the
GIL; if the interpreter is finalizing by then, CPython ends the thread with ``pthread_exit``, whose unwinding hits a
``noexcept`` destructor: ``std::terminate``, SIGABRT after the script finished. It needs the worker descheduled until
finalization starts: rare, likelier on a loaded machine (the core dumps' stack: docs/reliability.md, "A clean exit").

Only a group's destructor joins its workers (gloo's ``shutdown()`` does nothing; ``destroy_process_group`` only
unregisters), so ``engine.close()`` drops every reference the engine holds to its groups, freeing them while the
interpreter is whole. Groups others keep live to the end (a Trainer's default group is held by ``deepspeed.comm`` as
a default argument of its ``barrier``): for them the last exit hook (:func:`settle_gloo_workers`) releases the GIL
until every remaining worker has been seen waiting for work twice in a row (a worker late in dropping a work is
runnable, or takes the GIL at once while the main thread sleeps).
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
