"""A small random DeepSeek-V4 checkpoint written by transformers' own `save_pretrained`, plus MTP
weights under the official `mtp.0.*` names and a trained BPE tokenizer; runs offline in seconds.

Everything transformers' init leaves constant (sinks, compressor position biases, hyper-connection
bases and scales, norm weights, routing bias, the hash table) is randomised, so tests can see mistakes
in the code that uses them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["TINY_CONFIG", "TINY_DSPARK_TEXT_CONFIG", "make_tiny_checkpoint", "make_tiny_dspark_checkpoint"]

# MODEL_SPEC §10 with every layer type present (L0 sliding+hash, L1 CSA+hash, L2 HCA(8)+score,
# L3 CSA+score, L4 sliding+score, MTP sliding+score) and 8 indexer heads (fewer tie at zero scores).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 2,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 128, 4, 0, 0],
    "compress_rate_hca": 8,
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.1,
}

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def make_tiny_checkpoint(
    path: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json, model.safetensors (transformers names + official `mtp.*`) and a tokenizer.

    `overrides` replace keys of TINY_CONFIG (either config form). Returns the directory.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **(overrides or {})}
    torch.manual_seed(seed)
    hf_config = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    model = DeepseekV4ForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            _randomise(name, tensor, hf_config, gen)
    model.to(dtype).save_pretrained(path)
    _add_mtp_weights(path, raw, gen, dtype)
    _write_tokenizer(path, hf_config.vocab_size)
    return path


def _randomise(name: str, tensor: torch.Tensor, config: Any, gen: torch.Generator) -> None:
    """Replace transformers' constant initialisations by random, well-scaled values (in place)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        experts, per_token = config.n_routed_experts, tensor.shape[1]
        rows = [torch.randperm(experts, generator=gen)[:per_token] for _ in range(tensor.shape[0])]
        tensor.copy_(torch.stack(rows))
    elif leaf == "sinks" or leaf == "position_bias":
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    elif leaf in ("base", "hc_base"):
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    elif leaf in ("scale", "hc_scale"):
        tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
    elif leaf == "e_score_correction_bias":
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
    elif "norm" in name and leaf == "weight":
        tensor.copy_(1.0 + torch.randn(tensor.shape, generator=gen) * 0.1)
    elif name == "lm_head.weight":
        # Logits with a spread of a few units, as a trained model's: greedy picks are rarely near-ties.
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)


def _mtp_tensors(raw: dict[str, Any], gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from deepinfer_core.model_config import load_model_config
    from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer_core.platform.kernel_ops import KernelOps

    config = load_model_config({**raw, "quantization_config": None, "expert_dtype": None})
    model = DeepseekV4ForCausalLM(config, KernelOps(), dtype, torch.device("cpu"))
    std = float(raw.get("initializer_range", 0.02))
    tensors = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith("mtp."):
            continue
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(tensor.shape)
        if leaf == "attn_sink" or leaf == "ape" or name.endswith("_base"):
            value = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("_scale"):
            value = torch.rand(shape, generator=gen) + 0.5
        elif leaf == "bias":
            value = torch.randn(shape, generator=gen) * 0.1
        elif "norm" in name:
            value = 1.0 + torch.randn(shape, generator=gen) * 0.1
        else:
            value = torch.randn(shape, generator=gen) * std
        tensors[name] = value.to(tensor.dtype).contiguous()
    return tensors


def _add_mtp_weights(path: Path, raw: dict[str, Any], gen: torch.Generator, dtype: torch.dtype) -> None:
    if int(raw.get("num_nextn_predict_layers", 1)) == 0:
        return
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors.update(_mtp_tensors(raw, gen, dtype))
    save_file(tensors, file, metadata={"format": "pt"})


# The tiny V4.1 text config (tiny_v41_checkpoint.py) with three DSpark stages: six layers whose last three
# non-source layers (1, 3, 5; the DSpark targets) are no engram layer, 4 experts top-2 in the stages.
TINY_DSPARK_TEXT_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 6,
    "compress_ratios": [0, 0, 2, 2, 1, 0],
    "engram_layer_ids": [2],
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 4,
    "dspark_noise_token_id": 126,
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


def make_tiny_dspark_checkpoint(path: str | Path, *, text_overrides: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V4.1 checkpoint (no vision weights) plus DSpark weights under the official
    `mtp.{0,1,2}.*` names (MODEL_SPEC_V41 §10, §13). Returns the directory."""
    from deepinfer_core.models.deepseek_v41 import DeepseekV41ForCausalLM, parse_deepseek_v41_config
    from deepinfer_core.models.deepseek_v41.dspark import DSpark
    from deepinfer_core.platform.kernel_ops import KernelOps

    from .tiny_v41_checkpoint import _random, make_tiny_v41_checkpoint

    path = make_tiny_v41_checkpoint(path, vision=False, text_overrides={**TINY_DSPARK_TEXT_CONFIG,
                                                                         **(text_overrides or {})}, seed=seed)
    config = parse_deepseek_v41_config(json.loads((path / "config.json").read_text()))
    cpu = torch.device("cpu")
    target = DeepseekV41ForCausalLM(config, KernelOps(), torch.float32, cpu, kv_cache_dtype="bf16")
    dspark = DSpark(config, target, KernelOps(), torch.float32, cpu, kv_cache_dtype="bf16")
    gen = torch.Generator().manual_seed(seed + 1)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, t in dspark.state_dict().items():
        if "markov_head" in name:  # a logit correction of a few units, as the target head's
            value = torch.randn(tuple(t.shape), generator=gen) * 0.5
        elif "confidence_head" in name:  # confidences spread over (0, 1) rather than saturated
            value = torch.randn(tuple(t.shape), generator=gen) * 0.02
        else:
            value = _random(name, tuple(t.shape), gen)
        tensors[name] = value.to(t.dtype).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def _training_text() -> list[str]:
    """Python standard library sources: text every machine with Python has."""
    stdlib = Path(json.__file__).resolve().parent.parent
    names = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "shlex.py", "glob.py", "fnmatch.py"]
    return [(stdlib / name).read_text(encoding="utf-8") for name in names if (stdlib / name).is_file()]


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [BOS_TOKEN, EOS_TOKEN, "<｜User｜>", "<｜Assistant｜>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained tokenizer has {tokenizer.get_vocab_size()} tokens, expected vocab_size {vocab_size}: "
            "pick a vocab_size between 300 and the training text's capacity"
        )
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "model_max_length": 1048576,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random DeepSeek-V4 checkpoint with a tokenizer.")
    parser.add_argument("path", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                        help="replace a config key, e.g. --override hc_mult=2")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.override:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    out = make_tiny_checkpoint(args.path, overrides=overrides, seed=args.seed, dtype=getattr(torch, args.dtype))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
