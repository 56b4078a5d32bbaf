"""``shardtrain.integrations.accelerate``: the public name of :mod:`shardtrain.compat.accelerate` (this module replaces
itself in ``sys.modules`` with it: one module object under both names)."""

import sys

from shardtrain.compat import expose

sys.modules[__name__] = expose(__name__, "shardtrain.compat.accelerate")
