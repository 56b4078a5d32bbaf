"""Loading a Hub checkpoint is transformers' loading: the key layouts ``save_pretrained`` writes (and older
transformers versions wrote) for Mixtral, Qwen2-MoE, DeepSeek-V3 (per-expert tensors), GPT-NeoX (``embed_out``) and
ViT load in ``shardtrain.from_pretrained`` exactly as ``AutoModel*.from_pretrained`` loads them, at world 1 and
sharded at worlds 2 and 3 (ZeRO-3, each rank converting only the experts it holds), and what stays unloaded is named.

Two layouts per model: ``save_pretrained`` of the installed transformers (which reverts its own conversion on save),
and the per-expert layout older versions saved, written here by hand from the fused tensors (split in two files
with an index, so that one layer's experts straddle files).
"""

from __future__ import annotations

import json
import warnings
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

import shardtrain
from shardtrain.errors import ShardtrainError
from shardtrain.testing import run_distributed

transformers = pytest.importorskip("transformers")  # a dev dependency; always installed by `make test`

EXPERTS = 4
KINDS = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_neox", "vit"]
LAYOUTS = ["save_pretrained", "older"]


def hf_config(kind: str):
    small = {"vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2, "max_position_embeddings": 16}
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **small, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=1, num_local_experts=EXPERTS
        )
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **small,
            intermediate_size=24,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=12,
            num_hidden_layers=2,
            num_key_value_heads=1,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
        )
    if kind == "deepseek_v3":  # layer 0 dense, layer 1 routed experts + a shared one
        return transformers.DeepseekV3Config(
            **small,
            intermediate_size=24,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_key_value_heads=2,
            n_routed_experts=EXPERTS,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
        )
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(**small, intermediate_size=32, num_hidden_layers=2, tie_word_embeddings=False)
    return transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4
    )


def auto_class(kind: str):
    return transformers.AutoModelForImageClassification if kind == "vit" else transformers.AutoModelForCausalLM


def older_state(kind: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The key layout older transformers versions saved, made by hand from the model's (fused) state dict: per-expert
    ``experts.N.w1/w2/w3`` under ``block_sparse_moe`` (Mixtral) or ``experts.N.gate_proj/up_proj/down_proj``
    (Qwen2-MoE, DeepSeek-V3), ``embed_out`` (GPT-NeoX), ``encoder.layer.N.attention.attention.query`` (ViT)."""
    old = {}
    for name, value in state.items():
        if kind in ("mixtral", "qwen2_moe", "deepseek_v3") and ".experts." in name:
            layer = name.rsplit(".experts.", 1)[0]
            if kind == "mixtral":
                layer = layer.replace(".mlp", ".block_sparse_moe")
            gate, up, down = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for e in range(value.shape[0]):
                if name.endswith("gate_up_proj"):  # (experts, 2 x intermediate, hidden): gate rows, then up rows
                    first, second = value[e].chunk(2, dim=0)
                    old[f"{layer}.experts.{e}.{gate}.weight"] = first.clone()
                    old[f"{layer}.experts.{e}.{up}.weight"] = second.clone()
                else:
                    old[f"{layer}.experts.{e}.{down}.weight"] = value[e].clone()
            continue
        if kind == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if kind == "gpt_neox":
            name = name.replace("lm_head.", "embed_out.")
        if kind == "vit":
            for new, was in [
                ("vit.layers.", "vit.encoder.layer."),
                ("attention.q_proj", "attention.attention.query"),
                ("attention.k_proj", "attention.attention.key"),
                ("attention.v_proj", "attention.attention.value"),
                ("attention.o_proj", "attention.output.dense"),
                ("mlp.fc1", "intermediate.dense"),
                ("mlp.fc2", "output.dense"),
            ]:
                name = name.replace(new, was)
        old[name] = value.clone()
    return old


def write_checkpoint(kind: str, layout: str, path) -> None:
    torch.manual_seed(0)
    model = auto_class(kind).from_config(hf_config(kind))
    if layout == "save_pretrained":
        model.save_pretrained(path)
        return
    if layout == "model_names":  # what `shardtrain checkpoint consolidate` writes: the model's own (fused) names
        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
        return
    model.config.save_pretrained(path)
    state = older_state(kind, model.state_dict())
    assert state.keys() != model.state_dict().keys()
    names = sorted(state)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in files.items():
        save_file({k: state[k].contiguous() for k in keys}, str(path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in files.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def reference(kind: str, path) -> dict[str, torch.Tensor]:
    """What transformers' own from_pretrained loads from the same folder."""
    return auto_class(kind).from_pretrained(path).state_dict()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for name, value in want.items():
        assert torch.equal(got[name], value), (what, name)


def _config(stage: int) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("layout", [*LAYOUTS, "model_names"])
@pytest.mark.parametrize("kind", KINDS)
def test_hub_layout_loads_as_transformers_loads_it(kind, layout, tmp_path):
    """World 1: every parameter and buffer equals transformers' from_pretrained of the same folder, bit for bit."""
    write_checkpoint(kind, layout, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing is left unloaded, so nothing is warned
        engine = shardtrain.from_pretrained(auto_class(kind), tmp_path, _config(0), optimizer=_sgd)
    assert_same(engine.full_state_dict(), reference(kind, tmp_path), f"{kind} {layout}")


def _load_all(folders: list[tuple[str, str]]) -> dict:
    """Every folder at ZeRO-3 on this rank: the full state loaded, and which expert tensors this rank read."""
    import shardtrain.weights.loading as weights

    original, reads = weights._loader, []

    def counting(file, key):
        load = original(file, key)

        def counted():
            reads.append(key)
            return load()

        return counted

    weights._loader = counting
    out = {}
    try:
        for kind, path in folders:
            reads.clear()
            engine = shardtrain.from_pretrained(auto_class(kind), path, _config(3), optimizer=_sgd)
            sharded = all(u.buckets for u in engine._runtime.units) and bool(engine._runtime.units)
            out[path] = {"state": engine.full_state_dict(), "reads": list(reads), "sharded": sharded}
            engine.close()
    finally:
        weights._loader = original
    return out


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.soak), 3])  # world 3, the odd one, by default
def test_hub_layouts_load_sharded(world, tmp_path):
    """World 3 (and 2 under soak), ZeRO-3 (built under zero.Init): the loaded weights are transformers' exactly, and
    the ranks together read each expert tensor once, plus at most one more per fragment boundary inside a fused tensor
    ([Note: converted rows]): no rank reads every expert."""
    folders = []
    for kind in KINDS:
        for layout in LAYOUTS:
            path = tmp_path / f"{kind}-{layout}"
            path.mkdir()
            write_checkpoint(kind, layout, path)
            folders.append((kind, str(path)))
    results = run_distributed(_load_all, world, folders, timeout=600)
    for kind, path in folders:
        rank0 = results[0][path]
        assert rank0["sharded"], path
        assert_same(rank0["state"], reference(kind, path), f"{path} at world {world}")
        reads = Counter(k for r in results for k in r[path]["reads"])
        if kind in ("mixtral", "qwen2_moe", "deepseek_v3"):
            fused = {n for n in rank0["state"] if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
            stored = 3 * EXPERTS * len(fused) // 2  # per MoE layer: gate_up from 2 x experts, down from 1 x
            assert len(reads) == stored, (path, sorted(reads))  # every expert tensor read by some rank
            boundaries = 3 * (world - 1) * len(fused) // 2  # each boundary: one expert's pieces twice
            assert sum(reads.values()) <= stored + boundaries, (path, reads)
            assert sum(reads.values()) < world * stored, path
        else:
            assert not reads, (path, reads)  # renames only: read as rows or blocks, as any other tensor


def _renamed_router(path) -> None:
    """An older Mixtral folder whose routers are stored under a name no conversion knows."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    from safetensors.torch import load_file

    for file in sorted(set(index["weight_map"].values())):
        state = load_file(str(path / file))
        state = {k.replace("block_sparse_moe.gate.", "block_sparse_moe.router."): v for k, v in state.items()}
        save_file(state, str(path / file), metadata={"format": "pt"})
    index["weight_map"] = {
        k.replace("block_sparse_moe.gate.", "block_sparse_moe.router."): v for k, v in index["weight_map"].items()
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_keys_under_other_names_are_named_never_skipped(tmp_path):
    """Routers under a name the conversion cannot map: the error names both sides and says the conversion could not
    map them (no advice to pass strict=False); with strict=False a warning names every tensor left at its initial
    value and every stored tensor not loaded, and the rest is transformers' loading."""
    write_checkpoint("mixtral", "older", tmp_path)
    _renamed_router(tmp_path)
    cls = transformers.AutoModelForCausalLM
    with pytest.raises(ShardtrainError) as err:
        shardtrain.from_pretrained(cls, tmp_path, _config(0), optimizer=_sgd)
    message = str(err.value)
    assert "missing: model.layers.0.mlp.gate.weight, model.layers.1.mlp.gate.weight" in message
    assert "model.layers.0.block_sparse_moe.router.weight (mapped to model.layers.0.mlp.router.weight)" in message
    assert "conversion for MixtralForCausalLM could not map" in message and "strict=False" not in message

    with pytest.warns(UserWarning) as caught:
        engine = shardtrain.from_pretrained(cls, tmp_path, _config(0), optimizer=_sgd, strict=False)
    (warning,) = [str(w.message) for w in caught if "strict=False" in str(w.message)]
    assert "2 model tensor(s) keep their initial values: model.layers.0.mlp.gate.weight, " in warning
    assert "2 checkpoint tensor(s) are not loaded: model.layers.0.block_sparse_moe.router.weight" in warning
    got, want = engine.full_state_dict(), reference("mixtral", tmp_path)
    routers = {n for n in want if n.endswith("mlp.gate.weight")}
    assert_same({k: v for k, v in got.items() if k not in routers}, {k: want[k] for k in want.keys() - routers}, "")


def test_base_model_checkpoint_into_a_head_model(tmp_path):
    """A MixtralModel folder (no ``model.`` prefix, no head) into MixtralForCausalLM: transformers'
    ``base_model_prefix`` handling maps every key; only the head is missing, which strict names (and there the
    advice to pass strict=False stands), and strict=False warns of."""
    torch.manual_seed(0)
    transformers.MixtralModel(hf_config("mixtral")).save_pretrained(tmp_path)
    cls = transformers.AutoModelForCausalLM
    with pytest.raises(ShardtrainError, match=r"missing: lm_head\.weight\).*pass strict=False"):
        shardtrain.from_pretrained(cls, tmp_path, _config(0), optimizer=_sgd)
    with pytest.warns(UserWarning, match=r"1 model tensor\(s\) keep their initial values: lm_head\.weight$"):
        engine = shardtrain.from_pretrained(cls, tmp_path, _config(0), optimizer=_sgd, strict=False)
    got, want = engine.full_state_dict(), reference("mixtral", tmp_path)
    del got["lm_head.weight"], want["lm_head.weight"]
    assert_same(got, want, "base model into a head model")


def _load_blocks(kind: str, path: str, config: dict) -> dict:
    """``from_pretrained`` on this rank, with the shapes of every tensor-parallel block it read."""
    import shardtrain.weights.loading as weights

    original, blocks = weights._read_block, []

    def recording(part, block):
        values = original(part, block)
        blocks.append((tuple(part.get_shape()), tuple(values.shape)))
        return values

    weights._read_block = recording
    try:
        engine = shardtrain.from_pretrained(auto_class(kind), path, config, optimizer=_sgd)
    finally:
        weights._read_block = original
    out = {"state": engine.full_state_dict(), "blocks": blocks, "topology": engine.topology.replicas}
    engine.close()
    return out


TP_HYBRID = [
    ("gpt_neox", 2, {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 3}}),
    ("mixtral", 4, {"zero_optimization": {"stage": 3, "mics_shard_size": 2}}),
]


@pytest.mark.parametrize(("kind", "world", "config"), TP_HYBRID, ids=["gpt_neox-tp2-zero3", "mixtral-hybrid-2x2"])
def test_hub_layouts_under_tp_and_hybrid_sharding(kind, world, config, tmp_path):
    """GPT-NeoX's older layout (``embed_out``) at tp 2 under ZeRO-3: each split tensor, the renamed head included, is
    read as this rank's block only. Mixtral's older per-expert layout under hybrid sharding (2 replicas of 2 shards).
    Both load exactly what transformers' from_pretrained loads."""
    write_checkpoint(kind, "older", tmp_path)
    config = {"train_micro_batch_size_per_gpu": 1, **config}
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    results = run_distributed(_load_blocks, world, kind, str(tmp_path), config, timeout=600)
    assert_same(results[0]["state"], reference(kind, tmp_path), f"{kind} at world {world}")
    if kind == "gpt_neox":
        head = (hf_config(kind).vocab_size, hf_config(kind).hidden_size)
        for r in results:
            assert (head, (head[0] // 2, head[1])) in r["blocks"], r["blocks"]  # embed_out, read as lm_head's block
            for whole, block in r["blocks"]:
                assert torch.Size(block).numel() * 2 == torch.Size(whole).numel(), (whole, block)
    else:
        assert results[0]["topology"] == 2


def test_a_conversion_that_cannot_run_is_named(tmp_path):
    """An older Mixtral folder that lost one expert's w3: the converter cannot concatenate 4 gate and 3 up tensors.
    Every rank finds it on the headers alone, before anything is read, and the error names the tensor and the
    operations."""
    from safetensors.torch import load_file

    write_checkpoint("mixtral", "older", tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    lost = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    file = tmp_path / index["weight_map"].pop(lost)
    save_file({k: v for k, v in load_file(str(file)).items() if k != lost}, str(file), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    match = r"'model\.layers\.1\.mlp\.experts\.gate_up_proj': transformers' conversion \(MergeModulelist, Concat"
    with pytest.raises(ShardtrainError, match=match):
        shardtrain.from_pretrained(transformers.AutoModelForCausalLM, tmp_path, _config(0), optimizer=_sgd)


def test_keys_the_model_class_ignores(tmp_path, caplog):
    """What transformers' own loading drops without a word loads here too, with the names logged: stale
    ``attention.bias`` / ``attention.masked_bias`` buffers in an old GPT-NeoX folder (the class's
    ``_keys_to_ignore_on_load_unexpected``); and a head the class lets a checkpoint lack
    (``_keys_to_ignore_on_load_missing``) keeps its initial value with a warning naming it, even with strict."""
    from safetensors.torch import load_file

    write_checkpoint("gpt_neox", "save_pretrained", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    stale = {
        "gpt_neox.layers.0.attention.bias": torch.ones(1, 1, 16, 16),
        "gpt_neox.layers.1.attention.masked_bias": torch.tensor(-1e9),
    }
    save_file({**state, **stale}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="shardtrain"):
        engine = shardtrain.from_pretrained(auto_class("gpt_neox"), tmp_path, _config(0), optimizer=_sgd)
    assert_same(engine.full_state_dict(), reference("gpt_neox", tmp_path), "gpt_neox with stale buffers")
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "says to ignore them: gpt_neox.layers.0.attention.bias, gpt_neox.layers.1.attention.masked_bias" in logged

    class HeadOptional(transformers.GPTNeoXForCausalLM):
        _keys_to_ignore_on_load_missing = (r"lm_head",)

    del state["embed_out.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 model tensor\(s\) are not in the checkpoint, .* lm_head\.weight$"):
        shardtrain.from_pretrained(HeadOptional, tmp_path, _config(0), optimizer=_sgd)
