"""Every causal LM, masked LM and seq2seq architecture transformers registers, trained under the engine at world 2
against one process: ZeRO-3, and tensor or sequence parallelism where the model allows (``helpers/model_sweep.py``).

* The default run trains a slice (``model_sweep.DEFAULT_SLICE``: Llama, GPT-2, Qwen2, Gemma 2, GPT-NeoX, Mixtral,
  GPT-OSS, BERT, T5, BART) in all three modes; each mode must end as :data:`EXPECTED` says (a refusal by its reason).
* A learning rate 0.1% off on the engine's side is a mismatch: the comparison is not vacuous (also for GIT's extra
  image input and Reformer's train mode).
* A row of each way the sweep builds a model beyond its sizes (``BUILT_BEYOND_SIZES``) matches at ZeRO-3.
* Gemma 2 and Gemma 3 under ZeRO-3 with tensor parallelism 2: at world 2 (one data-parallel rank) and at world 4
  (two, so ZeRO shards each tensor-parallel block over them).
* ``-m soak`` runs every registered row, writes docs/models.md, and fails on any mismatch.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from helpers.model_sweep import (
    DEFAULT_SLICE,
    LR,
    MODES,
    merge_rows,
    read_table,
    registered_rows,
    run_batch,
    run_rows,
    write_doc,
)

# (category, model type) -> mode -> (status, a phrase of the refusal); absent: "match"
EXPECTED = {
    ("decoder-only", "gpt2"): {"tp": ("refused", "declares no tensor-parallel plan")},
    ("encoder-only", "bert"): {"tp": ("refused", "declares no tensor-parallel plan")},
}


MIN_DECODER_MATCHES = 186  # decoder-only rows matching at ZeRO-3 in docs/models.md's table (every one that builds)


@functools.cache
def _slice() -> dict:
    from shardtrain.testing import run_distributed

    return run_distributed(run_rows, 2, list(DEFAULT_SLICE), timeout=600)[0]


@pytest.mark.parametrize("row", DEFAULT_SLICE, ids="/".join)
def test_slice_matches_one_process_or_is_refused_by_its_reason(row):
    outcome = _slice()[f"{row[0]}/{row[1]}"]
    assert outcome["build"][0] == "ok" and "note" not in outcome, outcome
    for mode in MODES:
        status, detail = outcome[mode]
        want, phrase = EXPECTED.get(row, {}).get(mode, ("match", ""))
        assert status == want, (mode, status, detail)
        assert phrase in (detail or ""), (mode, detail)


def test_a_learning_rate_off_by_a_thousandth_is_a_mismatch():
    from shardtrain.testing import run_distributed

    got = run_distributed(run_rows, 2, [("decoder-only", "llama")], ("zero3",), LR * 1.001, timeout=300)[0]
    status, detail = got["decoder-only/llama"]["zero3"]
    assert status == "mismatch" and detail, (status, detail)


# A row of each way the sweep builds a model beyond sizes: the class's own text config of a composite one (Llama 4),
# a vision tower built small (Gemma 3), extra inputs (GIT's image), labels of another shape (MusicGen's codebooks),
# train mode (Reformer's reversible layers)
BUILT_BEYOND_SIZES = [
    ("decoder-only", "llama4"),
    ("decoder-only", "gemma3"),
    ("decoder-only", "git"),
    ("decoder-only", "musicgen"),
    ("decoder-only", "reformer"),
]


def test_models_built_beyond_sizes_match_one_process_at_zero3():
    from shardtrain.testing import run_distributed

    got = run_distributed(run_rows, 2, BUILT_BEYOND_SIZES, ("zero3",), timeout=600)[0]
    assert {k: (v["build"][0], v["zero3"]) for k, v in got.items()} == {
        f"{c}/{m}": ("ok", ("match", None)) for c, m in BUILT_BEYOND_SIZES
    }, got


@pytest.mark.parametrize("model_type", ["git", "reformer"])
def test_an_engine_learning_rate_off_by_a_thousandth_is_a_mismatch_for_extra_inputs_and_train_mode(model_type):
    """GIT's image and Reformer's train mode (hash buckets from a fixed seed) leave the comparison as sharp as for
    Llama."""
    from shardtrain.testing import run_distributed

    rows = [("decoder-only", model_type)]
    got = run_distributed(run_rows, 2, rows, ("zero3",), LR * 1.001, timeout=300)[0]
    status, detail = got[f"decoder-only/{model_type}"]["zero3"]
    assert status == "mismatch" and detail, (status, detail)


@pytest.mark.parametrize("world", [2, 4])
def test_gemma_zero3_with_tensor_parallelism_matches_one_process(world):
    """Gemma's scaled embedding, ``(1 + weight)`` norms and soft-capped logits under the engine with its own plan
    at tensor_parallel.size 2 and ZeRO stage 3 (world 4: two data-parallel ranks shard each block)."""
    from shardtrain.testing import run_distributed

    rows = [("decoder-only", "gemma2"), ("decoder-only", "gemma3_text")]
    got = run_distributed(run_rows, world, rows, ("tp",), timeout=600)[0]
    assert {k: v["tp"] for k, v in got.items()} == {f"{c}/{m}": ("match", None) for c, m in rows}, got


@pytest.mark.soak
def test_every_registered_architecture():
    """Every row (hours on two CPU cores: the hybrid state-space models' references are slow); rewrites the table of
    docs/models.md. No mode may mismatch; the share of decoder-only rows matching at ZeRO-3 may not fall below what
    docs/models.md reports."""
    outcomes = run_batch(registered_rows())
    write_doc(str(Path(__file__).parents[2] / "docs" / "models.md"), outcomes)
    mismatched = {
        f"{key} {mode}": value[1]
        for key, row in outcomes.items()
        for mode, value in row.items()
        if isinstance(value, tuple | list) and value[0] == "mismatch"
    }
    assert not mismatched, mismatched
    decoders = [row for key, row in outcomes.items() if key.startswith("decoder-only/")]
    matched = sum(row.get("zero3", ("",))[0] == "match" for row in decoders)
    assert matched >= MIN_DECODER_MATCHES, (matched, len(decoders))


def test_a_partial_rerun_keeps_the_other_rows_as_the_table_has_them(tmp_path):
    """``write --over-table``: the doc's table read back and written again is the same file, and a re-run row replaces
    its own line only."""
    doc = tmp_path / "models.md"
    original = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    doc.write_text(original)
    rows = read_table(str(doc))
    assert len(rows) == len(registered_rows())
    write_doc(str(doc), rows)
    assert doc.read_text() == original
    key = next(k for k, r in rows.items() if r["build"][0] == "ok")
    write_doc(str(doc), {**rows, key: {"build": ("ok", ""), **dict.fromkeys(MODES, ("refused", "a test's reason"))}})
    changed = [(a, b) for a, b in zip(original.splitlines(), doc.read_text().splitlines()) if a != b]
    category, model_type = key.split("/", 1)
    assert any(f"| {category} | {model_type} | refused: a test's reason |" in b for _, b in changed)
    counts_line = re.compile(r"\| [a-z-]+ \| \d+ \| (zero3|tp|sp) \|")  # the counts above the table
    assert all(f"| {category} | {model_type} |" in b or counts_line.match(b) for _, b in changed), changed
    merged = dict(rows)
    merge_rows(merged, {key: {"build": ("ok", ""), "tp": ("refused", "a re-run of tp only")}})
    assert merged[key] == {**rows[key], "tp": ("refused", "a re-run of tp only")}  # zero3 and sp kept
