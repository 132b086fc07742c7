"""A small random DeepSeek-V4.1 checkpoint (official names), optionally with a tiny vision tower, and a
WordLevel tokenizer; runs offline in a second.

The weights are drawn from DeepInfer's own model's parameter list (transformers' V4.1 is in no PyPI
release), so the checkpoint tests the engine's plumbing, not parity: the parity fixtures are
`tests/fixtures/deepseek_v41`, which are text-only. The tokenizer's vocabulary is "t0".."t{V-1}" (t0 BOS,
t1 EOS, t2 pad), except that the image token id is spelled `<｜deepseek_image｜>`; its chat template writes
"t4 <content>" per user turn and "t5" for the assistant, so prompts are whitespace-separated "tN" words.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["IMAGE_TOKEN", "TINY_V41_TEXT_CONFIG", "TINY_V41_VISION_CONFIG", "make_tiny_v41_checkpoint"]

IMAGE_TOKEN = "<｜deepseek_image｜>"

# Every layer role of MODEL_SPEC_V41 §2 in four layers: sliding (0), a ratio-2 KV source with an engram (1),
# a Reuse layer (2), a ratio-1 KV source that is the candidate source (3).
TINY_V41_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "compress_ratios": [0, 2, 2, 1],
    "candidate_topk_blocks": 2,
    "candidate_block_size": 4,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 4,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "hc_mult": 2,
    "engram_layer_ids": [1],
    "engram_vocab_size": 61,
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 16,
    "engram_compressed_vocab_size": 128,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1},
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# The release geometry (patch 14, downsample 3, the token limits deepseek-recipe sizes images for) with a
# tiny width: the preprocessing path is the release's.
TINY_V41_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 14,
    "downsample_ratio": 3,
    "rope_theta": 10000.0,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %} t4 {{ message['content'] }}"
    "{% else %} t5 {{ message['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} t5{% endif %}"
)


def make_tiny_v41_checkpoint(
    path: str | Path,
    *,
    vision: bool = True,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Write config.json (composite `deepseek_v41`), model.safetensors (float32) and a tokenizer.

    `vision=False` writes the vision_config but no vision weights (like the parity fixtures).
    The image token is the last id of the vocabulary. Returns the directory.
    """
    from deepinfer_core.models.deepseek_v41 import (
        DeepseekV41ForCausalLM,
        parse_deepseek_v41_config,
    )
    from deepinfer_core.platform.kernel_ops import KernelOps

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = {**TINY_V41_TEXT_CONFIG, **(text_overrides or {})}
    raw = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": {"model_type": "deepseek_v41_text", **text},
        "vision_config": {"model_type": "deepseek_v41_vision", **TINY_V41_VISION_CONFIG, **(vision_overrides or {})},
        "image_token_id": text["vocab_size"] - 1,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    config = parse_deepseek_v41_config(raw)
    model = DeepseekV41ForCausalLM(config, KernelOps(), torch.float32, torch.device("cpu"), kv_cache_dtype="bf16",
                                   vision=vision)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _random(name, tuple(t.shape), gen).to(t.dtype) for name, t in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False))
    _write_tokenizer(path, text["vocab_size"], raw["image_token_id"])
    return path


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "attn_sink" or name.endswith("_base"):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("_scale"):
        return torch.rand(shape, generator=gen) + 0.5
    if name.endswith("gate.bias"):
        return torch.randn(shape, generator=gen) * 0.1
    if name.endswith("gate.bias_vl"):  # far from `bias`, so image tokens visibly route apart
        return torch.randn(shape, generator=gen)
    if ("norm" in name and leaf == "weight") or leaf in ("q_weight", "k_weight"):
        return 1.0 + torch.randn(shape, generator=gen) * 0.1
    if name.startswith("image_") or name == "embed.weight" or name.endswith("engram.embed.weight"):
        return torch.randn(shape, generator=gen)
    if name == "head.weight":
        return torch.randn(shape, generator=gen) * 0.5
    if leaf == "bias":
        return torch.randn(shape, generator=gen) * 0.02
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def _write_tokenizer(path: Path, vocab_size: int, image_token_id: int) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    del vocab[f"t{image_token_id}"]
    vocab[IMAGE_TOKEN] = image_token_id
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # single_word: else "t12" would match the special "t1" and split
    tokenizer.add_special_tokens([AddedToken(f"t{i}", normalized=False, single_word=True) for i in range(3)])
    tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, normalized=False)])
    if tokenizer.get_vocab_size() != vocab_size or tokenizer.token_to_id(IMAGE_TOKEN) != image_token_id:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} ids and the image token at "
                           f"{tokenizer.token_to_id(IMAGE_TOKEN)}; expected {vocab_size} and {image_token_id}")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "t0",
        "eos_token": "t1",
        "pad_token": "t2",
        "model_max_length": 1048576,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random DeepSeek-V4.1 checkpoint with a tokenizer.")
    parser.add_argument("path", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-vision", action="store_true", help="write no vision weights")
    args = parser.parse_args(argv)
    print(make_tiny_v41_checkpoint(args.path, vision=not args.no_vision, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
