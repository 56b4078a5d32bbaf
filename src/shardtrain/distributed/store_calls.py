"""Calls on the rendezvous store that end by a deadline, even when the process hosting the store is stopped.

[Note: every wait on the store is bounded]
A TCPStore client waits on its socket without limit while the store's host is stopped (SIGSTOP, a debugger, a page
storm), whatever the store's timeout: measured on torch 2.13 with a 3 s store timeout and the server stopped,
``check``, ``add`` and ``compare_set`` had not returned after 15 s; ``get``, ``multi_get`` and ``wait`` log a timeout
after 3 s, then wait for the answer to their cancellation, for ever; ``set`` returns (it reads no answer). So every
store call of shardtrain goes through :class:`BoundedStore`: the call runs on a daemon thread, the caller waits at
most :func:`limit_s` (the collective timeout, at most :data:`ANSWER_S`) and then gets a :class:`StoreSilentError`
naming the store's host and address. The silent call keeps its thread, and with it the client's lock (every call on
that client takes it): until it returns, later calls on that store fail at once with the same error; once it has
returned (the host resumed), calls run again.
A silent store fails nothing by itself: a wait probe that meets it returns, and the collective's own timeout ends the
wait; the failure survey then names the store's host as the reason, as does the NCCL watchdog at the collective
timeout. So every other rank names a stopped store host within ``collective_timeout_s`` + :func:`limit_s` (+ the
0.5 s of a probe's slice). Limit: a silent call's thread that wakes while its process is finalizing (the store's host
killed or resumed just then) aborts that process (CPython ends it with ``pthread_exit`` from inside torch).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from shardtrain.errors import ShardtrainError

ANSWER_S = 10.0
"""The most one store call may take, whatever the collective timeout (a live store answers in milliseconds). A longer
stall fails nothing (see the Note): it only ends a probe's look early, or is named once a collective failed."""

_timeout_s = ANSWER_S
"""The collective timeout of the Communicator built last (:func:`use_collective_timeout`)."""
_lock = threading.Lock()
_silent: dict[int, tuple[threading.Thread, str]] = {}
"""Stores with a call that did not answer in time, by ``id`` of the client: (the call's thread, the error's text)."""


class StoreSilentError(ShardtrainError, TimeoutError):
    """A call on the rendezvous store was not answered in time: its host is stopped, hung or unreachable."""


def use_collective_timeout(timeout_s: float) -> None:
    """Bound store calls by ``timeout_s`` too (a Communicator's ``collective_timeout_s``; see the Note)."""
    global _timeout_s
    _timeout_s = timeout_s


def limit_s() -> float:
    """How long one store call may take: the collective timeout, at most :data:`ANSWER_S`."""
    return min(_timeout_s, ANSWER_S)


def address(store: Any) -> str | None:
    """``host:port`` of the TCP store under ``store``'s prefixes, or None (another kind of store)."""
    for _ in range(8):
        if hasattr(store, "port"):
            return f"{getattr(store, 'host', '?')}:{store.port}"
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def host_of(store: Any) -> str:
    """Who hosts ``store``: the torchrun agent of the first node when its port is the agent's ``MASTER_PORT`` under
    ``TORCHELASTIC_USE_AGENT_STORE``, else rank 0 ([Note: restarts under torchrun] in
    :mod:`shardtrain.distributed.mesh`)."""
    where = address(store)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent and where is not None and where.rpartition(":")[2] == os.environ.get("MASTER_PORT"):
        return "the torchrun agent of the first node (node rank 0)"
    return "rank 0"


class BoundedStore:
    """A c10d store whose calls end within ``limit`` seconds (default :func:`limit_s`; see [Note: every wait on the
    store is bounded]). ``key``: the client's identity, the same for every wrapper of one client."""

    def __init__(self, store: Any, limit: float | None = None) -> None:
        self.store, self.limit = store, limit
        self.key = id(store)

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def _call(self, method: str, *args: Any) -> Any:
        limit = self.limit if self.limit is not None else limit_s()
        with _lock:
            thread, message = _silent.get(self.key, (None, ""))
            if thread is not None and not thread.is_alive():  # it returned: the host answers again
                del _silent[self.key]
                thread = None
        if thread is not None:
            raise StoreSilentError(message)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = getattr(self.store, method)(*args)
            except Exception as err:  # handed to the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=run, name=f"shardtrain-store-{method}", daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            where = address(self.store)
            who = f"{host_of(self.store)} (the store's host, {where})" if where else f"the {type(self.store).__name__}"
            message = f"{who} did not answer within {limit:g} s: stopped, hung or unreachable"
            with _lock:
                _silent.setdefault(self.key, (thread, message))
            raise StoreSilentError(message)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")
