"""accelerate's DeepSpeed path on shardtrain: :func:`use_shardtrain_for_deepspeed`.

A plain accelerate loop written for DeepSpeed (``Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))``, ``prepare``,
``backward``, ``accumulate``, ``save_state``/``load_state``, ``get_state_dict``) runs on shardtrain with one change at
the top of the script, before accelerate prepares anything::

    from shardtrain.integrations.accelerate import use_shardtrain_for_deepspeed

    use_shardtrain_for_deepspeed()  # accelerate's `import deepspeed` is now shardtrain.deepspeed

See docs/migration-accelerate.md.

[Note: accelerate's DeepSpeed is shardtrain.deepspeed]
accelerate imports ``deepspeed`` inside its functions, when it needs it (``deepspeed.comm.init_distributed`` when the
state is made, ``deepspeed.initialize`` and ``deepspeed.runtime.lr_schedules`` in ``prepare``, ``DeepSpeedEngine`` to
unwrap a model, ``deepspeed.checkpoint.utils`` in ``get_state_dict``), and asks the package metadata whether
DeepSpeed is installed and which version it is. So the route is the one the public names already take
(:func:`shardtrain.compat.expose`): ``deepspeed`` and each of its submodules in ``sys.modules`` are the shim's modules,
and a metadata finder, first on ``sys.meta_path``, answers for the ``deepspeed`` distribution with the release the
shim follows (a real DeepSpeed need not be installed, and one that is does not decide accelerate's code paths).
Nothing of accelerate is patched: every call it makes lands on the shim, which runs shardtrain's engine or refuses
the name, saying what to use.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Any

from shardtrain.compat import expose
from shardtrain.errors import ConfigError, ShardtrainError

__all__ = ["launch_world_problem", "use_shardtrain_for_deepspeed"]

SHIM = "shardtrain.compat.deepspeed"
TESTED_ACCELERATE = ">=1.15,<2"


class _ShimDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution as package metadata describes it: name and version (the shim's)."""

    def __init__(self, version: str) -> None:
        self._metadata = f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n"

    def read_text(self, filename: str) -> str | None:
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path: Any) -> Any:
        return path


class _ShimMetadataFinder:
    """First on ``sys.meta_path``: ``importlib.metadata`` asks it before the installed distributions."""

    def __init__(self, version: str) -> None:
        self.version = version

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None  # finds no module: the modules are in sys.modules already

    def find_distributions(self, context: Any = None) -> list:
        name = getattr(context, "name", None)  # None: every distribution asked for
        if name is not None and name.lower().replace("-", "_") != "deepspeed":
            return []
        return [_ShimDistribution(self.version)]


def use_shardtrain_for_deepspeed() -> None:
    """Make ``import deepspeed`` give :mod:`shardtrain.deepspeed` in this process, for accelerate (and anything
    imported after); see [Note: accelerate's DeepSpeed is shardtrain.deepspeed]. Call it once at the top of the
    script, on every rank; a second call does nothing. Raises :class:`ShardtrainError` when the real DeepSpeed was
    imported already (its objects would stay in use beside the shim's)."""
    current = sys.modules.get("deepspeed")
    if current is not None and getattr(current, "__name__", "") != SHIM:
        raise ShardtrainError(
            "use_shardtrain_for_deepspeed(): the real deepspeed was imported before it in this process; call it "
            "first, at the top of the script, before anything imports deepspeed"
        )
    shim = expose("deepspeed", SHIM)
    sys.modules["deepspeed"] = shim
    if not any(isinstance(f, _ShimMetadataFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ShimMetadataFinder(shim.__version__))


def launch_world_problem(seen: int, who: str) -> str | None:
    """What is wrong when accelerate (``who``: the ``TrainingArguments`` or the ``Accelerator``) counts ``seen``
    processes and the launcher started another number; None when they agree. The launcher's count is
    torch.distributed's world size, or ``WORLD_SIZE`` (torchrun's) before a process group exists.

    On a machine without a GPU, accelerate joins the processes that torchrun started only when told to run on the
    CPU; otherwise each process trains alone, and the batch sizes it derives are those of one process."""
    import torch
    import torch.distributed as dist

    launched = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if seen == launched:
        return None
    problem = f"{who} sees {seen} process(es), but {launched} were launched (torch.distributed's world size)"
    if torch.cuda.is_available():
        return problem + "; launch one process per GPU with torchrun or `accelerate launch`"
    fix = (
        "TrainingArguments(use_cpu=True)"
        if who == "TrainingArguments"
        else "Accelerator(..., kwargs_handlers=[InitProcessGroupKwargs(backend='gloo')])"
    )
    return problem + f": on a machine without a GPU accelerate joins them only when told to use the CPU; pass {fix}"


def check_launch_world(seen: int, who: str) -> None:
    """:func:`launch_world_problem` as a :class:`ConfigError`."""
    problem = launch_world_problem(seen, who)
    if problem is not None:
        raise ConfigError(problem)


def check_accelerate_world() -> None:
    """Called by ``deepspeed.initialize`` (the shim's): when accelerate prepares the model, its count of processes
    must be torch.distributed's (else its data loader gives every rank all batches, and the batch sizes it writes
    into the config are one process's). Does nothing outside accelerate."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    if shared and "num_processes" in shared:
        check_launch_world(shared["num_processes"], "the Accelerator")
