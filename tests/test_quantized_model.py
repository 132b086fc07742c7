"""A checkpoint quantised by scripts/quantize_checkpoint.py runs in the model like its dequantised float copy."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from conftest import build_cache, build_forward_batch
from safetensors.torch import save_file

from deepinfer_core.model_config import load_model_config
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.quantization import dequantize_fp4, dequantize_fp8_block
from deepinfer_core.weights import load_model_weights
from deepinfer_core.weights.reader import iter_official_tensors

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "quantize_checkpoint.py"


def quantize(source: Path, output: Path, experts: str) -> None:
    main = runpy.run_path(str(SCRIPT), run_name="quantize_checkpoint")["main"]
    main([str(source), str(output), "--experts", experts, "--max-shard-size", "150000"])


def write_dequantised_copy(quantised: Path, output: Path) -> None:
    """The same weights in float32 under official names, with the quantization settings removed."""
    tensors = dict(iter_official_tensors(quantised))
    floats = {}
    for name, tensor in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            floats[name] = tensor
        elif tensor.dtype == torch.int8:
            floats[name] = dequantize_fp4(tensor, scale, torch.float32)
        else:
            floats[name] = dequantize_fp8_block(tensor, scale, (128, 128), torch.float32)
    output.mkdir()
    save_file({k: v.contiguous() for k, v in floats.items()}, str(output / "model.safetensors"))
    config = json.loads((quantised / "config.json").read_text())
    config.pop("quantization_config")
    config.pop("expert_dtype", None)
    (output / "config.json").write_text(json.dumps(config))


def logits(
    checkpoint: Path, prompt: torch.Tensor, fp8_activations: bool = False, ops: KernelOps | None = None
) -> tuple[torch.Tensor, DeepseekV4ForCausalLM]:
    config = load_model_config(checkpoint)
    ops = ops or KernelOps()
    ops.fp8_activations = fp8_activations
    model = DeepseekV4ForCausalLM(config, ops, torch.float32, torch.device("cpu"))
    load_model_weights(model, checkpoint)
    cache = build_cache(config, num_slots=1, dtype=torch.float32)
    out = model(build_forward_batch([(prompt, 0, 0, list(range(cache.num_blocks)))]), cache)
    return model.compute_logits(out.hidden), model


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_quantised_checkpoint_matches_the_dequantised_float_model(tiny_checkpoint, tmp_path, experts):
    quantised, dequantised = tmp_path / "quantised", tmp_path / "dequantised"
    quantize(tiny_checkpoint, quantised, experts)
    write_dequantised_copy(quantised, dequantised)
    prompt = torch.randint(0, load_model_config(tiny_checkpoint).vocab_size, (40,),
                           generator=torch.Generator().manual_seed(5))

    got, model = logits(quantised, prompt)
    want, _ = logits(dequantised, prompt)

    dtypes = {t.dtype for t in model.state_dict().values()}
    assert torch.float8_e4m3fn in dtypes and torch.float8_e8m0fnu in dtypes
    assert (torch.int8 in dtypes) == (experts == "fp4")
    # Dequantisation is exact, so both models multiply identical float32 weights; only where the
    # dequantised matrix is formed may change the summation order (KernelOps.linear: 1e-5 relative).
    error = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert error.max() <= 1e-5
    original, _ = logits(tiny_checkpoint, prompt)
    assert not torch.allclose(original, got, rtol=0, atol=0), "quantisation must have changed the weights"


def test_quantised_checkpoint_keeps_the_tokenizer_and_generation_files(tiny_checkpoint, tmp_path):
    quantised = tmp_path / "quantised"
    quantize(tiny_checkpoint, quantised, "fp4")
    side_files = [p.name for p in tiny_checkpoint.iterdir() if p.suffix != ".safetensors" and p.name != "config.json"]
    assert "tokenizer.json" in side_files
    for name in side_files:
        assert (quantised / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8") / "quantised"
    quantize(tiny_checkpoint, path, "fp8")
    return path


def test_fp8_activations_change_only_a_checkpoint_with_fp8_weights(tiny_checkpoint, fp8_checkpoint):
    prompt = torch.randint(0, load_model_config(fp8_checkpoint).vocab_size, (40,),
                           generator=torch.Generator().manual_seed(6))
    w8a16, _ = logits(fp8_checkpoint, prompt)
    w8a8, _ = logits(fp8_checkpoint, prompt, fp8_activations=True)
    # Rounding each input to e4m3 moves it by ~2.5% (rms); this random 5-layer model amplifies that to
    # 10-45% on the logits (random 2% input noise gives 8-20%), so only "it changed" is asserted here:
    # the ops' agreement with this rounding is the kernel and conformance tests' job.
    assert ((w8a8 - w8a16).norm(dim=-1) / w8a16.norm(dim=-1)).min() > 1e-3
    dense, _ = logits(tiny_checkpoint, prompt)
    assert torch.equal(logits(tiny_checkpoint, prompt, fp8_activations=True)[0], dense)


class CodesTakingOps(KernelOps):
    """The reference ops with wo_a and wo_b taking their inputs as fp8 codes, as a backend that quantises in the
    attention's and wo_a's epilogues does (`quantized_input_group`); counts the ops that hand codes over."""

    def __init__(self) -> None:
        self.quantized_attentions = self.quantized_projections = 0

    def quantized_input_group(self, weight: torch.Tensor, block: tuple[int, int] | None) -> int | None:
        # The tiny model's wo_a rows (64 columns) are shorter than a K block: the product rounds a row as one group.
        return min(block[1], weight.shape[1]) if self.fp8_activations and weight.dtype == torch.float8_e4m3fn else None

    def rotary_attention_quantized(self, *args, **kwargs):
        self.quantized_attentions += 1
        return super().rotary_attention_quantized(*args, **kwargs)

    def grouped_linear_quantized(self, *args, **kwargs):
        self.quantized_projections += 1
        return super().grouped_linear_quantized(*args, **kwargs)


def test_attention_handing_wo_a_and_wo_b_fp8_codes_computes_the_same_bits(fp8_checkpoint):
    prompt = torch.randint(0, load_model_config(fp8_checkpoint).vocab_size, (40,),
                           generator=torch.Generator().manual_seed(7))
    ops = CodesTakingOps()
    got, model = logits(fp8_checkpoint, prompt, fp8_activations=True, ops=ops)
    assert ops.quantized_attentions == ops.quantized_projections == model.config.num_hidden_layers
    assert torch.equal(got, logits(fp8_checkpoint, prompt, fp8_activations=True)[0])


def test_llm_with_fp8_activations_generates_what_the_model_computes(fp8_checkpoint):
    from deepinfer_core import LLM, SamplingParams

    prompt = [40, 41, 300, 7, 99, 12]
    llm = LLM(str(fp8_checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=2, fp8_activations=True)
    assert llm.model.ops.fp8_activations
    [out] = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), use_tqdm=False)
    tokens = list(prompt)
    for _ in range(4):  # the model alone, the whole sequence each time
        step_logits, _ = logits(fp8_checkpoint, torch.tensor(tokens), fp8_activations=True)
        tokens.append(int(step_logits[-1].argmax()))
    assert list(out.outputs[0].token_ids) == tokens[len(prompt):]


def test_fp8_activations_need_fp8_weights(tiny_checkpoint):
    from deepinfer_core import LLM

    with pytest.raises(ValueError, match="no fp8 weights"):
        LLM(str(tiny_checkpoint), accelerator="cpu", dtype="float32", fp8_activations=True)
