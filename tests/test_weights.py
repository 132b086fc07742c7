"""Checkpoint loading: both naming schemes on real transformers checkpoints, shards, expert filter, bad files.

The checkpoints are written by transformers' own `DeepseekV4ForCausalLM.save_pretrained` (MODEL_SPEC §10
tiny config, every parameter randomised so that a swapped tensor cannot go unseen). The model side is a
bare module tree whose entry names are the official names (the contract with the model code), so these
tests do not depend on the model implementation.
"""

import json
import re
import shutil
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.weights import (
    CheckpointMismatch,
    CheckpointNotFound,
    CorruptCheckpoint,
    UnsafeCheckpointFormat,
    load_model_weights,
)
from deepinfer_core.weights.names import fused_experts, official_name

transformers = pytest.importorskip("transformers")

TINY_CONFIG = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, num_hash_layers=2, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=8, compress_ratios=[0, 4, 128, 4, 0, 0],
    compress_rate_hca=8, compress_rope_theta=160000, rope_theta=10000,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    max_position_embeddings=1048576, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, num_nextn_predict_layers=1, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1,
)
NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER = 5, 8, 64, 32

# MODEL_SPEC §8, written out independently of deepinfer_core.weights.names: every official tensor name.
OFFICIAL_NAME = re.compile(
    r"^(?:embed\.weight|head\.weight|norm\.weight|hc_head_(?:fn|base|scale)"
    r"|(?:layers|mtp)\.\d+\.(?:"
    r"attn_norm\.weight|ffn_norm\.weight|hc_(?:attn|ffn)_(?:fn|base|scale)"
    r"|attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)\.weight|attn\.attn_sink"
    r"|attn\.compressor\.(?:wkv\.weight|wgate\.weight|ape|norm\.weight)"
    r"|attn\.indexer\.(?:wq_b\.weight|weights_proj\.weight)"
    r"|attn\.indexer\.compressor\.(?:wkv\.weight|wgate\.weight|ape|norm\.weight)"
    r"|ffn\.gate\.(?:weight|bias|tid2eid)|ffn\.experts\.\d+\.w[123]\.weight|ffn\.shared_experts\.w[123]\.weight"
    r"|e_proj\.weight|h_proj\.weight|enorm\.weight|hnorm\.weight|norm\.weight|hc_head_(?:fn|base|scale)))$"
)


class Tree(torch.nn.Module):
    """A module tree built from dotted names, standing in for a model built with official names."""

    def __init__(self, entries: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__()
        for name, (shape, dtype) in entries.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, torch.full(shape, 7, dtype=dtype) if dtype.is_floating_point
                                   else torch.zeros(shape, dtype=dtype))


def randomise(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(torch.randint(0, NUM_EXPERTS, tensor.shape, generator=generator))


def reference_official_tensors(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official name -> value from transformers' in-memory module names, by MODEL_SPEC §8's table (by hand)."""
    renames = [
        ("model.embed_tokens.weight", "embed.weight"), ("lm_head.weight", "head.weight"),
        ("model.hc_head.hc_", "hc_head_"), ("model.", ""),
        ("self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"),
        ("self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"),
        ("self_attn.compressor.indexer.", "attn.indexer.compressor."), ("self_attn.", "attn."),
        ("q_a_proj", "wq_a"), ("q_a_norm", "q_norm"), ("q_b_proj", "wq_b"), ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b"),
        ("sinks", "attn_sink"), ("position_bias", "ape"), ("gate_proj", "wgate"), ("kv_proj", "wkv"),
        ("compressor.kv_norm", "compressor.norm"), ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"), ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_"), ("mlp.", "ffn."),
        ("e_score_correction_bias", "bias"), ("shared_experts.wgate", "shared_experts.w1"),
        ("shared_experts.up_proj", "shared_experts.w3"), ("shared_experts.down_proj", "shared_experts.w2"),
    ]
    out = {}
    for name, value in hf_state.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            block = name.removeprefix("model.").split(".mlp.")[0]
            for e in range(value.shape[0]):
                if name.endswith("gate_up_proj"):
                    out[f"{block}.ffn.experts.{e}.w1.weight"] = value[e, :INTER]
                    out[f"{block}.ffn.experts.{e}.w3.weight"] = value[e, INTER:]
                else:
                    out[f"{block}.ffn.experts.{e}.w2.weight"] = value[e]
            continue
        for old, new in renames:
            name = name.replace(old, new)
        out[name] = value
    return out


def mtp_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Official `mtp.0.*` tensors (transformers does not build the MTP block)."""
    generator = torch.Generator().manual_seed(seed)
    hc = 4 * HIDDEN
    shapes = {
        "e_proj.weight": (HIDDEN, HIDDEN), "h_proj.weight": (HIDDEN, HIDDEN), "enorm.weight": (HIDDEN,),
        "hnorm.weight": (HIDDEN,), "norm.weight": (HIDDEN,), "hc_head_fn": (4, hc), "hc_head_base": (4,),
        "hc_head_scale": (1,), "attn_norm.weight": (HIDDEN,), "ffn_norm.weight": (HIDDEN,),
        "hc_attn_fn": (24, hc), "hc_attn_base": (24,), "hc_attn_scale": (3,), "hc_ffn_fn": (24, hc),
        "hc_ffn_base": (24,), "hc_ffn_scale": (3,), "attn.wq_a.weight": (32, HIDDEN), "attn.q_norm.weight": (32,),
        "attn.wq_b.weight": (128, 32), "attn.wkv.weight": (32, HIDDEN), "attn.kv_norm.weight": (32,),
        "attn.wo_a.weight": (32, HIDDEN), "attn.wo_b.weight": (HIDDEN, 32), "attn.attn_sink": (4,),
        "ffn.gate.weight": (NUM_EXPERTS, HIDDEN), "ffn.gate.bias": (NUM_EXPERTS,),
        "ffn.shared_experts.w1.weight": (INTER, HIDDEN), "ffn.shared_experts.w3.weight": (INTER, HIDDEN),
        "ffn.shared_experts.w2.weight": (HIDDEN, INTER),
    }
    for e in range(NUM_EXPERTS):
        shapes |= {f"ffn.experts.{e}.w1.weight": (INTER, HIDDEN), f"ffn.experts.{e}.w3.weight": (INTER, HIDDEN),
                   f"ffn.experts.{e}.w2.weight": (HIDDEN, INTER)}
    return {f"mtp.0.{k}": torch.randn(s, generator=generator) for k, s in shapes.items()}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A `save_pretrained` checkpoint plus official `mtp.0.*`, and the expected official tensors."""
    config = transformers.DeepseekV4Config(**TINY_CONFIG)
    model = transformers.DeepseekV4ForCausalLM(config)
    randomise(model, seed=0)
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory)
    mtp = mtp_tensors(seed=1)
    save_file(mtp, str(directory / "mtp.safetensors"))
    index = directory / "model.safetensors.index.json"
    if not index.exists():  # one shard: list both files in an index so the mtp file is found
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
        weight_map |= {k: "mtp.safetensors" for k in mtp}
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    expected = reference_official_tensors({k: v.clone() for k, v in model.state_dict().items()}) | mtp
    return directory, expected


def model_for(expected: dict[str, torch.Tensor], float_dtype=torch.bfloat16, keep=lambda name: True) -> Tree:
    return Tree({n: (tuple(t.shape), float_dtype if t.is_floating_point() else t.dtype)
                 for n, t in expected.items() if keep(n)})


def assert_loaded(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, expected[name].to(tensor.dtype), rtol=0, atol=0, msg=name)


def write_official_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], shards: int = 3) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(directory / file))
        weight_map |= {n: file for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    return directory


# --- names -------------------------------------------------------------------------------------


def test_saved_names_and_module_names_map_to_the_same_official_names(hf_checkpoint):
    directory, expected = hf_checkpoint
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY_CONFIG))
    from_modules = set()
    for name, tensor in model.state_dict().items():
        fused = fused_experts(name)
        from_modules |= {n for e in range(tensor.shape[0]) for n in fused.names(e)} if fused else {official_name(name)}
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        from_saved = {official_name(k) for k in f.keys()}
    assert from_saved == from_modules
    assert from_saved | set(mtp_tensors(0)) == set(expected)
    unmapped = sorted(n for n in from_saved if not OFFICIAL_NAME.match(n))
    assert not unmapped


@pytest.mark.parametrize(
    ("stored", "official"),
    [
        ("model.embed_tokens.weight", "embed.weight"),
        ("lm_head.weight", "head.weight"),
        ("head.weight", "head.weight"),
        ("model.norm.weight", "norm.weight"),
        ("model.hc_head.hc_fn", "hc_head_fn"),
        ("model.hc_head.hc_scale", "hc_head_scale"),
        ("model.layers.3.self_attn.q_a_proj.weight", "layers.3.attn.wq_a.weight"),
        ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
        ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
        ("model.layers.3.self_attn.sinks", "layers.3.attn.attn_sink"),
        ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
        ("model.layers.3.self_attn.compressor.position_bias", "layers.3.attn.compressor.ape"),
        ("model.layers.3.self_attn.compressor.indexer.kv_proj.weight", "layers.3.attn.indexer.compressor.wkv.weight"),
        ("model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
         "layers.3.attn.indexer.weights_proj.weight"),
        ("model.layers.3.self_attn.compressor.indexer.q_b_proj.weight", "layers.3.attn.indexer.wq_b.weight"),
        ("model.layers.3.attn_hc.fn", "layers.3.hc_attn_fn"),
        ("model.layers.3.ffn_hc.base", "layers.3.hc_ffn_base"),
        ("model.layers.3.input_layernorm.weight", "layers.3.attn_norm.weight"),
        ("model.layers.3.mlp.gate.e_score_correction_bias", "layers.3.ffn.gate.bias"),
        ("model.layers.0.mlp.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
        ("model.layers.3.mlp.shared_experts.up_proj.weight", "layers.3.ffn.shared_experts.w3.weight"),
        ("layers.3.ffn.experts.5.w2.weight", "layers.3.ffn.experts.5.w2.weight"),
        ("layers.3.attn.indexer.compressor.norm.weight", "layers.3.attn.indexer.compressor.norm.weight"),
        ("mtp.0.e_proj.weight", "mtp.0.e_proj.weight"),
        ("model.layers.3.self_attn.q_b_proj.weight_scale_inv", "layers.3.attn.wq_b.scale"),
        ("layers.3.attn.wq_b.scale", "layers.3.attn.wq_b.scale"),
        ("mtp.0.attn.kv_norm.weight", "mtp.0.attn.kv_norm.weight"),
    ],
)
def test_official_name(stored, official):
    assert official_name(stored) == official


# --- loading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("float_dtype", [torch.float32, torch.bfloat16])
def test_loads_a_save_pretrained_checkpoint(hf_checkpoint, float_dtype):
    directory, expected = hf_checkpoint
    model = model_for(expected, float_dtype)
    load_model_weights(model, directory)
    assert_loaded(model, expected)


def test_loads_transformers_module_names_with_fused_experts(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY_CONFIG))
    randomise(model, seed=2)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    want = reference_official_tensors(state)
    loaded = model_for(want, torch.float32)
    load_model_weights(loaded, tmp_path)
    assert_loaded(loaded, want)


def test_loads_a_sharded_official_checkpoint(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    directory = write_official_checkpoint(tmp_path / "official", expected, shards=4)
    model = model_for(expected)
    load_model_weights(model, directory)
    assert_loaded(model, expected)


def test_copies_onto_the_model_entrys_storage(hf_checkpoint):
    directory, expected = hf_checkpoint
    model = model_for(expected, torch.float32)
    storage = model.state_dict()["layers.2.attn.wq_a.weight"].data_ptr()
    load_model_weights(model, directory)
    assert model.state_dict()["layers.2.attn.wq_a.weight"].data_ptr() == storage


class ReadSpy:
    """Wraps the loader's `open_shard`: records what is read, how many shards are open at once, and how many
    tensors handed out earlier are still alive when the next one is read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from deepinfer_core.weights import loader

        self.read: list[tuple[str, int | None]] = []
        self.open_now = self.max_open = self.max_alive = 0
        self._handed_out: list[weakref.ref] = []
        real_open = loader.open_shard

        @contextmanager
        def spying_open(path):
            with real_open(path) as handle:
                self.open_now += 1
                self.max_open = max(self.max_open, self.open_now)
                try:
                    yield _SpyHandle(handle, self)
                finally:
                    self.open_now -= 1

        monkeypatch.setattr(loader, "open_shard", spying_open)

    def hand_out(self, name: str, index: int | None, tensor: torch.Tensor) -> torch.Tensor:
        self.max_alive = max(self.max_alive, sum(ref() is not None for ref in self._handed_out))
        self._handed_out.append(weakref.ref(tensor))
        self.read.append((name, index))
        return tensor


class _SpyHandle:
    def __init__(self, handle, spy: ReadSpy) -> None:
        self.handle, self.spy = handle, spy

    def get_tensor(self, name):
        return self.spy.hand_out(name, None, self.handle.get_tensor(name))

    def get_slice(self, name):
        spy, sliced = self.spy, self.handle.get_slice(name)

        class Slice:
            def __getitem__(self, index):
                return spy.hand_out(name, index, sliced[index])

        return Slice()


EXPERT_NAME = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.")


def rank0_of_2(layer: int, expert: int) -> bool:
    """A fake expert-parallel layout: rank 0 of 2 owns different experts in each layer."""
    return (layer + expert) % 2 == 0


def owned_by_rank0(name: str) -> bool:
    match = EXPERT_NAME.match(name)
    if match is None:
        return True
    layer = int(match[2]) + (NUM_LAYERS if match[1] == "mtp" else 0)
    return rank0_of_2(layer, int(match[3]))


def test_expert_filter_loads_only_the_owned_experts(hf_checkpoint, monkeypatch):
    directory, expected = hf_checkpoint
    calls = []

    def expert_filter(layer: int, expert: int) -> bool:
        calls.append((layer, expert))
        return rank0_of_2(layer, expert)

    spy = ReadSpy(monkeypatch)
    model = model_for(expected, keep=owned_by_rank0)
    load_model_weights(model, directory, expert_filter=expert_filter)
    assert_loaded(model, expected)
    assert (NUM_LAYERS, 1) in calls, "MTP block 0 must be passed as layer num_hidden_layers + 0"
    read_experts = [official_name(n) for n, _ in spy.read if EXPERT_NAME.match(official_name(n))]
    assert len(read_experts) == 3 * NUM_EXPERTS // 2 * (NUM_LAYERS + 1)
    assert all(owned_by_rank0(n) for n in read_experts)


def test_expert_filter_reads_only_owned_slices_of_fused_experts(monkeypatch, tmp_path):
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY_CONFIG))
    randomise(model, seed=3)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    want = reference_official_tensors(state)
    spy = ReadSpy(monkeypatch)
    loaded = model_for(want, torch.float32, keep=owned_by_rank0)
    load_model_weights(loaded, tmp_path, expert_filter=rank0_of_2)
    assert_loaded(loaded, want)
    fused_reads = [(name, index) for name, index in spy.read if index is not None]
    assert fused_reads and all(rank0_of_2(int(name.split(".")[2]), index) for name, index in fused_reads)


def test_loading_holds_one_shard_and_one_tensor_at_a_time(hf_checkpoint, tmp_path, monkeypatch):
    _, expected = hf_checkpoint
    directory = write_official_checkpoint(tmp_path / "ckpt", expected, shards=3)
    spy = ReadSpy(monkeypatch)
    load_model_weights(model_for(expected), directory)
    assert len(spy.read) == len(expected)
    assert spy.max_open == 1
    assert spy.max_alive == 0, "a tensor read from disk outlived its copy into the model"


def test_expert_filter_does_not_require_or_check_unowned_experts(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    broken = dict(expected)
    broken["layers.1.ffn.experts.3.w1.weight"] = torch.randn(5, 5)  # not owned below: must not be looked at
    directory = write_official_checkpoint(tmp_path / "ckpt", broken)
    model = model_for(expected, keep=lambda name: ".ffn.experts.3." not in name)
    load_model_weights(model, directory, expert_filter=lambda layer, expert: expert != 3)
    assert_loaded(model, expected)


# --- bad checkpoints ---------------------------------------------------------------------------


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    partial = {k: v for k, v in expected.items() if k != "layers.3.attn.indexer.wq_b.weight"}
    directory = write_official_checkpoint(tmp_path / "ckpt", partial)
    with pytest.raises(CheckpointMismatch, match=r"lacks 1 tensor.*`layers\.3\.attn\.indexer\.wq_b\.weight`"):
        load_model_weights(model_for(expected), directory)


def test_unexpected_tensor_is_named(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    directory = write_official_checkpoint(tmp_path / "ckpt", expected | {"layers.2.attn.extra": torch.ones(3)})
    with pytest.raises(CheckpointMismatch, match=r"unexpected tensor `layers\.2\.attn\.extra`"):
        load_model_weights(model_for(expected), directory)


def test_wrong_shape_is_named(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    wrong = expected | {"layers.4.attn.wo_b.weight": torch.ones(64, 31)}
    directory = write_official_checkpoint(tmp_path / "ckpt", wrong)
    with pytest.raises(CheckpointMismatch, match=r"`layers\.4\.attn\.wo_b\.weight`.*shape \[64, 31\].*\[64, 32\]"):
        load_model_weights(model_for(expected), directory)


def test_wrong_dtype_is_named(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    as_float = expected | {"layers.0.ffn.gate.tid2eid": expected["layers.0.ffn.gate.tid2eid"].float()}
    directory = write_official_checkpoint(tmp_path / "ckpt", as_float)
    with pytest.raises(CheckpointMismatch, match=r"`layers\.0\.ffn\.gate\.tid2eid`.*torch\.float32.*torch\.int64"):
        load_model_weights(model_for(expected), directory)


def test_quantised_tensor_into_a_float_model_entry_is_refused(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    fp8 = expected | {"layers.1.attn.wkv.weight": expected["layers.1.attn.wkv.weight"].to(torch.float8_e4m3fn)}
    directory = write_official_checkpoint(tmp_path / "ckpt", fp8)
    with pytest.raises(CheckpointMismatch, match=r"`layers\.1\.attn\.wkv\.weight`.*float8_e4m3fn"):
        load_model_weights(model_for(expected), directory)


def test_tensor_provided_twice_is_named(hf_checkpoint, tmp_path):
    directory, expected = hf_checkpoint
    copy = tmp_path / "twice"
    shutil.copytree(directory, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    save_file({"model.embed_tokens.weight": torch.ones(512, 64)}, str(copy / "extra.safetensors"))
    index["weight_map"]["embed.weight"] = "extra.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatch, match=r"`embed\.weight` is provided twice"):
        load_model_weights(model_for(expected), copy)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) - 100],  # truncated tensor data
        lambda data: data[:6],  # not even a header length
        lambda data: (10**12).to_bytes(8, "little") + data[8:],  # header length beyond the file
        lambda data: data[:8] + b"\xff" * 32 + data[40:],  # garbage header bytes
    ],
    ids=["truncated-data", "truncated-header", "huge-header-length", "garbage-header"],
)
def test_corrupt_shard_fails_fast_naming_the_file(hf_checkpoint, tmp_path, damage):
    _, expected = hf_checkpoint
    directory = write_official_checkpoint(tmp_path / "ckpt", expected, shards=3)
    victim = directory / "model-00002-of-00003.safetensors"
    victim.write_bytes(damage(victim.read_bytes()))
    model = model_for(expected, torch.float32)
    before = model.state_dict()["embed.weight"].clone()
    with pytest.raises(CorruptCheckpoint, match="model-00002-of-00003.safetensors"):
        load_model_weights(model, directory)
    assert torch.equal(model.state_dict()["embed.weight"], before), "nothing is copied before the plan is checked"


def test_index_naming_a_missing_shard_is_reported(hf_checkpoint, tmp_path):
    _, expected = hf_checkpoint
    directory = write_official_checkpoint(tmp_path / "ckpt", expected, shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointNotFound, match="model-00002-of-00002.safetensors"):
        load_model_weights(model_for(expected), directory)


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.pt", "weights.pth", "last.ckpt"])
def test_pickle_checkpoints_are_refused(tmp_path, filename):
    torch.save({"embed.weight": torch.ones(2)}, tmp_path / filename)
    with pytest.raises(UnsafeCheckpointFormat, match=filename):
        load_model_weights(Tree({"embed.weight": ((2,), torch.float32)}), tmp_path)


def test_index_pointing_at_pickle_shards_is_refused(tmp_path):
    index = {"weight_map": {"embed.weight": "pytorch_model-00001-of-00001.bin"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeCheckpointFormat, match="pytorch_model-00001-of-00001.bin"):
        load_model_weights(Tree({"embed.weight": ((2,), torch.float32)}), tmp_path)


def test_directory_without_weights_is_reported(tmp_path):
    with pytest.raises(CheckpointNotFound, match="no model.safetensors.index.json and no"):
        load_model_weights(Tree({"embed.weight": ((2,), torch.float32)}), tmp_path)


# --- quantised checkpoints (scripts/quantize_checkpoint.py) --------------------------------------

# MODEL_SPEC §8's storage table for every tensor of a block (layer prefix and expert number removed).
STORED_AS = {
    "attn.wq_a.weight": "fp8", "attn.wq_b.weight": "fp8", "attn.wkv.weight": "fp8", "attn.wo_a.weight": "fp8",
    "attn.wo_b.weight": "fp8", "attn.indexer.wq_b.weight": "fp8", "ffn.shared_experts.w1.weight": "fp8",
    "ffn.shared_experts.w2.weight": "fp8", "ffn.shared_experts.w3.weight": "fp8", "e_proj.weight": "fp8",
    "h_proj.weight": "fp8", "ffn.experts.E.w1.weight": "experts", "ffn.experts.E.w2.weight": "experts",
    "ffn.experts.E.w3.weight": "experts",
    "hc_attn_fn": torch.float32, "hc_attn_base": torch.float32, "hc_attn_scale": torch.float32,
    "hc_ffn_fn": torch.float32, "hc_ffn_base": torch.float32, "hc_ffn_scale": torch.float32,
    "hc_head_fn": torch.float32, "hc_head_base": torch.float32, "hc_head_scale": torch.float32,
    "attn.attn_sink": torch.float32, "attn.compressor.ape": torch.float32,
    "attn.indexer.compressor.ape": torch.float32, "ffn.gate.bias": torch.float32, "ffn.gate.tid2eid": torch.int64,
    "attn_norm.weight": torch.bfloat16, "ffn_norm.weight": torch.bfloat16, "attn.q_norm.weight": torch.bfloat16,
    "attn.kv_norm.weight": torch.bfloat16, "attn.compressor.wkv.weight": torch.bfloat16,
    "attn.compressor.wgate.weight": torch.bfloat16, "attn.compressor.norm.weight": torch.bfloat16,
    "attn.indexer.weights_proj.weight": torch.bfloat16, "attn.indexer.compressor.wkv.weight": torch.bfloat16,
    "attn.indexer.compressor.wgate.weight": torch.bfloat16, "attn.indexer.compressor.norm.weight": torch.bfloat16,
    "ffn.gate.weight": torch.bfloat16, "enorm.weight": torch.bfloat16, "hnorm.weight": torch.bfloat16,
    "norm.weight": torch.bfloat16, "embed.weight": torch.bfloat16, "head.weight": torch.bfloat16,
}


def stored_as(name: str, experts: str):
    generic = re.sub(r"^(?:layers|mtp)\.\d+\.", "", re.sub(r"\.experts\.\d+\.", ".experts.E.", name))
    kind = STORED_AS[generic]
    return experts if kind == "experts" else kind


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, also for one-byte formats (fp8, e8m0) that have no comparison kernels."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 \
        else torch.equal(a, b)


def run_quantize_script(*argv: str) -> None:
    import runpy

    script = Path(__file__).resolve().parents[1] / "scripts" / "quantize_checkpoint.py"
    runpy.run_path(str(script), run_name="quantize_checkpoint")["main"](list(argv))


@pytest.fixture(scope="module")
def float_source(hf_checkpoint, tmp_path_factory) -> Path:
    directory, _ = hf_checkpoint
    source = tmp_path_factory.mktemp("float") / "src"
    shutil.copytree(directory, source)
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return source


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_quantize_script_writes_the_official_layout(hf_checkpoint, float_source, tmp_path, experts):
    from deepinfer_core.quantization import quantize_fp4, quantize_fp8_block

    _, expected = hf_checkpoint
    output = tmp_path / "quantised"
    run_quantize_script(str(float_source), str(output), "--experts", experts, "--max-shard-size", "100KB")

    config = json.loads((output / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    assert config.get("expert_dtype") == ("fp4" if experts == "fp4" else None)
    assert config["num_hidden_layers"] == NUM_LAYERS and config["dtype"] == "bfloat16"
    assert (output / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (output / "tokenizer_config.json").exists()
    index = json.loads((output / "model.safetensors.index.json").read_text())
    shards = sorted(output.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}

    stored = stored_tensors(output)
    assert set(index["weight_map"]) == set(stored)
    weights = {n for n in stored if not n.endswith(".scale")}
    assert weights == set(expected)
    for name in weights:
        kind, value = stored_as(name, experts), expected[name]
        if kind in ("fp8", "fp4"):
            weight, scale = quantize_fp8_block(value) if kind == "fp8" else quantize_fp4(value)
            assert stored[name].dtype == weight.dtype and same_bits(stored[name], weight), name
            scale_name = name.removesuffix(".weight") + ".scale"
            assert same_bits(stored[scale_name], scale), scale_name
        else:
            assert stored[name].dtype == kind, name
            assert torch.equal(stored[name], value.to(kind)), name
    assert {n for n in stored if n.endswith(".scale")} == {
        n.removesuffix(".weight") + ".scale" for n in weights if stored_as(n, experts) in ("fp8", "fp4")
    }


def test_quantised_checkpoint_loads_exactly_into_a_quantised_model(float_source, tmp_path):
    output = tmp_path / "quantised"
    run_quantize_script(str(float_source), str(output), "--max-shard-size", "60000")
    stored = stored_tensors(output)
    model = Tree({n: (tuple(t.shape), t.dtype) for n, t in stored.items()})
    load_model_weights(model, output, expert_filter=lambda layer, expert: True)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == stored[name].dtype and same_bits(tensor, stored[name]), name


def test_quantising_a_quantised_checkpoint_or_into_a_used_directory_is_refused(float_source, tmp_path):
    from deepinfer_core.weights.errors import CheckpointError

    output = tmp_path / "quantised"
    run_quantize_script(str(float_source), str(output))
    with pytest.raises(CheckpointError, match="already has a quantization_config"):
        run_quantize_script(str(output), str(tmp_path / "again"))
    with pytest.raises(CheckpointError, match="already holds safetensors"):
        run_quantize_script(str(float_source), str(output))


def test_expert_width_that_fp4_cannot_hold_is_named(tmp_path):
    from deepinfer_core.weights.errors import CheckpointError

    tensors = {"layers.0.ffn.experts.0.w2.weight": torch.randn(64, 40), "embed.weight": torch.randn(8, 64)}
    write_official_checkpoint(tmp_path / "src", tensors, shards=1)
    with pytest.raises(CheckpointError, match=r"`layers\.0\.ffn\.experts\.0\.w2\.weight` as fp4.*multiple of 32"):
        run_quantize_script(str(tmp_path / "src"), str(tmp_path / "out"))
