"""``import shardtrain.deepspeed as deepspeed``: the public name of :mod:`shardtrain.compat.deepspeed`.

This module replaces itself in ``sys.modules`` with that package, and names each of its submodules under this
name too, so ``shardtrain.deepspeed.zero`` and ``shardtrain.compat.deepspeed.zero`` are one module object."""

import sys

from shardtrain.compat import expose

sys.modules[__name__] = expose(__name__, "shardtrain.compat.deepspeed")
