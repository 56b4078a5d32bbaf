"""The error raised for a part of DeepSpeed's API that ``shardtrain.deepspeed`` does not provide."""

from __future__ import annotations

from shardtrain.errors import ShardtrainError

DOCS = "docs/migration-deepspeed.md"


class NotProvidedError(ShardtrainError, AttributeError):
    """A DeepSpeed name or argument that shardtrain's DeepSpeed API does not provide.

    It is an ``AttributeError`` too, so that ``hasattr(deepspeed, name)`` and ``getattr(..., default)`` keep
    working in scripts that probe for optional features; its message names what was asked for and what to do."""


def not_provided(what: str, instead: str = "") -> NotProvidedError:
    """``what``: DeepSpeed's name as a script writes it (``deepspeed.comm``, ``engine.save_16bit_model()``)."""
    hint = f"; {instead}" if instead else ""
    error = NotProvidedError(f"{what} is not provided by shardtrain.deepspeed{hint} (what is provided: {DOCS})")
    error.instead = instead  # what to do instead, alone (the docs' table of DeepSpeed's names shows it)
    return error
