"""The suite's ranks are forked from a server that has already imported transformers and the modules of the models
they build most (``preload`` in ``tests/conftest.py``): a rank finds them in ``sys.modules`` before it imports
anything, so no test pays their import once per rank."""

import sys

from shardtrain.testing import run_distributed


def _imported_before_the_rank_imports_anything() -> list[str]:
    wanted = (
        "transformers",
        "transformers.models.llama.modeling_llama",
        "transformers.models.mixtral.modeling_mixtral",
    )
    return [name for name in wanted if name in sys.modules]


def test_ranks_start_with_transformers_and_the_suites_models_imported():
    for imported in run_distributed(_imported_before_the_rank_imports_anything, 2, timeout=120):
        assert imported == [
            "transformers",
            "transformers.models.llama.modeling_llama",
            "transformers.models.mixtral.modeling_mixtral",
        ]
