"""The error raised for a part of DeepSpeed's API that ``shardtrain.deepspeed`` does not provide."""

from __future__ import annotations

import sys
from typing import Any

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


class RefusedImports:
    """The last finder on ``sys.meta_path``: an import of a name under ``shardtrain.deepspeed`` that no module
    provides (``from deepspeed.ops.adam import DeepSpeedCPUAdam``, ``from deepspeed.utils import groups``) raises
    ``ModuleNotFoundError`` with the ``NotProvidedError`` message of the package that refuses it, which says what to use
    instead. Python's own message ("No module named ...", "cannot import name ...") would drop that. An
    ``ImportError``, so that ``try: import ... except ImportError`` in a script takes its fallback as before.

    Consulted only after the ordinary finders found nothing, and only for the packages of ``shardtrain.deepspeed``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        parent_name, _, child = fullname.rpartition(".")
        parent = sys.modules.get(parent_name)
        refuse = getattr(parent, "__getattr__", None)
        if refuse is None or not getattr(parent, "__name__", "").startswith("shardtrain.compat.deepspeed"):
            return None
        try:
            refuse(child)
        except NotProvidedError as err:
            # name=None: with the name given, `from package import x` would swallow it and say "cannot import name"
            raise ModuleNotFoundError(str(err), name=None) from None
        except AttributeError:
            return None
        return None


def install_refused_imports() -> None:
    if not any(isinstance(f, RefusedImports) for f in sys.meta_path):
        sys.meta_path.append(RefusedImports())
