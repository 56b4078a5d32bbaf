"""Exceptions a user can cause; each message says what was done and what to do instead."""

from __future__ import annotations


class ShardtrainError(Exception):
    """Base class of every error shardtrain raises on purpose."""


class ConfigError(ShardtrainError, ValueError):
    """The configuration has an unknown key, a wrong type or an impossible value."""


class LayoutError(ConfigError):
    """The requested parallel layout cannot be built from the processes that exist (a kind of :class:`ConfigError`:
    the plan refuses sizes as this and combinations as its parent, and a caller catches both as one)."""


class RankMismatchError(ShardtrainError, RuntimeError):
    """Ranks that must agree (config, model structure, collective order) do not."""


class CollectiveError(ShardtrainError, RuntimeError):
    """A collective failed; the message names this rank, what it waited for, and what is known of the others."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within ``collective_timeout_s``; the message names the rank and what it
    waited for."""


class PeerLostError(CollectiveError):
    """A collective failed because another rank's process is gone (killed, e.g. by the OOM killer, or exited); the
    message names that rank when it can be known (see [Note: naming the rank that vanished])."""


class OptimizerError(ShardtrainError, ValueError):
    """The optimizer handed to ``initialize`` cannot be sharded as given."""


class CheckpointError(ShardtrainError, RuntimeError):
    """A checkpoint cannot be written or read as asked (missing, damaged, unsupported, inconsistent pieces)."""


class PublishError(CheckpointError):
    """The checkpoint a save was publishing is gone or incomplete (its directory deleted, or removed by another job's
    clean-up): ``latest`` was not moved and still names the previous checkpoint ([Note: publish what exists] in
    ``shardtrain.checkpoint.latest``)."""


class SaveDirInUseError(CheckpointError):
    """Another job owns the save directory ([Note: one job per save directory] in ``shardtrain.checkpoint.owner``);
    nothing in it was touched."""


class UnsafePickleError(CheckpointError):
    """A pickled file refers to a class or function outside the allow-list of the format being read; nothing from
    it was run (see [Note: restricted unpickling] in ``shardtrain.checkpoint.safe_pickle``)."""


class GraphCaptureError(ShardtrainError, RuntimeError):
    """Graph mode cannot capture the module as asked (``graph.strict`` and a construct that must run eagerly)."""


class OffloadError(ShardtrainError, RuntimeError):
    """A swap directory or file cannot be created, written or read; the message names the rank and the path."""
