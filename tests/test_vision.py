"""DeepSeek-V4.1 image input (MODEL_SPEC_V41 §11): vision tower, aligner, span layout, preprocessing, engine.

NOTE: no reference run of the vision path exists. transformers' V4.1 vision tower is in no PyPI release
and the golden fixtures are text-only, so the tower and aligner are checked against an independent,
deliberately plain reading of the spec written here (explicit pair rotations, per-window gathers, span
loops), and the engine against the model run alone on the same embedded inputs.
Tiny random weights: `deepinfer_core.tools.make_tiny_v41_checkpoint` (release image geometry, width 16).
"""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from deepinfer_core import LLM, InvalidRequestError, SamplingParams
from deepinfer_core.engine.chat import encode_conversation
from deepinfer_core.engine.images import (
    ImageInputError,
    PromptImages,
    expand_image_placeholders,
    image_bytes,
    preprocess_image,
)
from deepinfer_core.models.deepseek_v41 import (
    DeepseekV41Cache,
    DeepseekV41ForCausalLM,
    parse_deepseek_v41_config,
)
from deepinfer_core.models.deepseek_v41.config import DeepseekV41VisionConfig
from deepinfer_core.models.deepseek_v41.engram import DEAD, EngramHasher
from deepinfer_core.models.deepseek_v41.image_span import (
    StepImages,
    span_length,
    span_vectors,
)
from deepinfer_core.models.deepseek_v41.moe import route
from deepinfer_core.models.deepseek_v41.vision import Aligner, VisionTower
from deepinfer_core.platform.kernel_ops import KernelOps
from deepinfer_core.tools import make_tiny_v41_checkpoint
from deepinfer_core.weights.loader import load_model_weights

CPU = torch.device("cpu")
# float32 model against a float64 reference: matmuls of width <= 72 and a softmax agree to ~1e-6;
# 1e-5 leaves room for the different summation orders without hiding a misplaced channel (O(1) errors).
TOWER_TOL = 1e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
IMAGE_BUDGET = 512  # > every prompt here: an image prompt is prefilled in one chunk


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v41_checkpoint(tmp_path_factory.mktemp("v41") / "tiny-v41-vision", seed=3)


@pytest.fixture(scope="module")
def llm(vision_checkpoint: Path) -> LLM:
    return LLM(str(vision_checkpoint), accelerator="cpu", dtype="float32", kv_cache_dtype="bf16", max_num_seqs=4,
               num_kv_blocks=256, block_size=8, max_num_batched_tokens=IMAGE_BUDGET)


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Random-noise RGB image: every pixel differs, so a transposed or shifted patch changes the result."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


# ---------------------------------------------------------------------------------------------------
# An independent reading of MODEL_SPEC_V41 §11, in float64: explicit per-pair rotations, einsum attention,
# per-window gathers, loops over the span layout.


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def ref_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.einsum("nk,ok->no", x, weight)
    return y if bias is None else y + bias


def ref_rope(x: torch.Tensor, rows: list[int], cols: list[int], theta: float) -> torch.Tensor:
    """x [N, heads, d]: channel i pairs with channel i + d/2; the first d/4 pairs turn with the patch's
    row, the rest with its column; frequency of pair j (per axis) = theta^(-j / (d/4))."""
    d = x.shape[-1]
    out = x.clone()
    quarter = d // 4
    rows_t, cols_t = torch.tensor(rows, dtype=torch.float64), torch.tensor(cols, dtype=torch.float64)
    for i in range(d // 2):
        angle = (rows_t if i < quarter else cols_t) * theta ** (-(i % quarter) / quarter)
        cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[:, :, i], x[:, :, i + d // 2]
        out[:, :, i] = a * cos - b * sin
        out[:, :, i + d // 2] = b * cos + a * sin
    return out


def ref_tower(w: dict[str, torch.Tensor], c: DeepseekV41VisionConfig, patches: torch.Tensor, h: int,
              width: int) -> torch.Tensor:
    rows = [p // width for p in range(h * width)]
    cols = [p % width for p in range(h * width)]
    heads, d = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    x = ref_linear(patches, w["vision.patch_embed.proj.weight"], w["vision.patch_embed.proj.bias"])
    for layer in range(c.num_hidden_layers):
        pre = f"vision.blocks.{layer}."
        y = ref_rms_norm(x, w[pre + "norm1.weight"], c.rms_norm_eps)
        qkv = ref_linear(y, w[pre + "attn.wqkv.weight"], w[pre + "attn.wqkv.bias"])
        q = qkv[:, : c.hidden_size].reshape(-1, heads, d)
        k = qkv[:, c.hidden_size: 2 * c.hidden_size].reshape(-1, heads, d)
        v = qkv[:, 2 * c.hidden_size:].reshape(-1, heads, d)
        q, k = ref_rope(q, rows, cols, c.rope_theta), ref_rope(k, rows, cols, c.rope_theta)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(-1, c.hidden_size)
        x = x + ref_linear(attn, w[pre + "attn.wo.weight"], w[pre + "attn.wo.bias"])
        y = ref_rms_norm(x, w[pre + "norm2.weight"], c.rms_norm_eps)
        hidden = ref_linear(y, w[pre + "mlp.w1.weight"])
        gate, up = hidden[:, : c.intermediate_size], hidden[:, c.intermediate_size:]
        x = x + ref_linear(gate * torch.sigmoid(gate) * up, w[pre + "mlp.w2.weight"])
    return ref_rms_norm(x, w["vision.norm.weight"], c.rms_norm_eps)


def ref_aligner(w: dict[str, torch.Tensor], features: torch.Tensor, h: int, width: int, r: int) -> torch.Tensor:
    """One row per r x r window, row-major; its features ordered (channel, dy, dx), zero outside the grid."""
    channels = features.shape[1]
    out = []
    for wy in range(-(-h // r)):
        for wx in range(-(-width // r)):
            window = torch.zeros(channels, r, r, dtype=features.dtype)
            for dy in range(r):
                for dx in range(r):
                    y, x = wy * r + dy, wx * r + dx
                    if y < h and x < width:
                        window[:, dy, dx] = features[y * width + x]
            out.append(window.flatten())
    hidden = ref_linear(torch.stack(out), w["aligner.w1.weight"], w["aligner.w1.bias"])
    hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    return ref_linear(hidden, w["aligner.w2.weight"], w["aligner.w2.bias"])


def ref_span(slots: torch.Tensor, h: int, width: int, r: int, start, newline, end) -> torch.Tensor:
    rows, cols = -(-h // r), -(-width // r)
    span = [start]
    for row in range(rows):
        span.extend(slots[row * cols + col] for col in range(cols))
        span.append(newline)
    span.append(end)
    return torch.stack(span)


# ---------------------------------------------------------------------------------------------------


SMALL_VISION = DeepseekV41VisionConfig(hidden_size=16, intermediate_size=12, num_hidden_layers=2,
                                       num_attention_heads=2, patch_size=2, downsample_ratio=3)


def test_tower_and_aligner_match_an_independent_reading_of_the_spec() -> None:
    """Several images in one call (attention must stay within each), grids that are and are not
    multiples of the downsample ratio, and grids with one row or one column."""
    c, text_hidden = SMALL_VISION, 24
    ops = KernelOps()
    tower, aligner = VisionTower(c, ops, torch.float32, CPU), Aligner(c, text_hidden, ops, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for prefix, module in (("vision.", tower), ("aligner.", aligner)):
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            value = 1.0 + 0.1 * noise if "norm" in name else 0.3 * noise
            param.data.copy_(value)
            weights[prefix + name] = value.double()
    marks = [torch.randn(text_hidden, generator=gen) for _ in range(3)]
    grids = [(4, 5), (7, 3), (3, 3), (1, 2), (2, 1)]
    patches = [torch.randn(h * w, 3 * c.patch_size**2, generator=gen) for h, w in grids]

    features = tower(torch.cat(patches), grids).split([h * w for h, w in grids])
    for (h, w), image, own in zip(grids, patches, features):
        expected = ref_tower(weights, c, image.double(), h, w)
        torch.testing.assert_close(own.double(), expected, rtol=TOWER_TOL, atol=TOWER_TOL)
        slots = aligner(own, (h, w))
        expected_slots = ref_aligner(weights, expected, h, w, c.downsample_ratio)
        torch.testing.assert_close(slots.double(), expected_slots, rtol=TOWER_TOL, atol=TOWER_TOL)
        rows, cols = -(-h // 3), -(-w // 3)
        span = span_vectors(slots, rows, cols, *marks)
        torch.testing.assert_close(span, ref_span(slots, h, w, 3, *marks), rtol=0, atol=0)
        assert span.shape[0] == span_length(h, w, 3)


def test_the_models_image_spans_match_the_reference_on_the_checkpoint(llm: LLM, vision_checkpoint: Path) -> None:
    """The loaded model (release geometry: 14-pixel patches of a deepseek-recipe-sized image, two images in
    one call) against the reference on the checkpoint's own tensors, including image_start/newline/end."""
    from safetensors.torch import load_file

    weights = {name: t.double() for name, t in load_file(str(vision_checkpoint / "model.safetensors")).items()
               if name.startswith(("vision.", "aligner.", "image_"))}
    c = llm.model_config.vision_config
    images = [preprocess_image(picture(30, 20, seed=11), c), preprocess_image(picture(20, 45, seed=12), c)]
    spans = llm.model.embed_images([i.patches for i in images], [i.grid for i in images])
    for image, span in zip(images, spans):
        (h, w), patches = image.grid, image.patches.double()
        slots = ref_aligner(weights, ref_tower(weights, c, patches, h, w), h, w, c.downsample_ratio)
        expected = ref_span(slots, h, w, c.downsample_ratio, weights["image_start"], weights["image_newline"],
                            weights["image_end"])
        torch.testing.assert_close(span.double(), expected, rtol=TOWER_TOL, atol=TOWER_TOL)


@pytest.mark.parametrize(("h", "w"), [(1, 1), (3, 3), (4, 5), (7, 3), (2, 10), (35, 44), (39, 39), (213, 8)])
def test_span_token_counts(h: int, w: int) -> None:
    """IMAGE_START + ceil(h/3) rows of (ceil(w/3) slots + IMAGE_NEWLINE) + IMAGE_END."""
    assert span_length(h, w, 3) == math.ceil(h / 3) * (math.ceil(w / 3) + 1) + 2
    expanded, spans = expand_image_placeholders([0, 9, 7, 9, 5], 7, [span_length(h, w, 3)])
    assert expanded == [0, 9] + [7] * span_length(h, w, 3) + [9, 5]
    assert spans == ((2, span_length(h, w, 3)),)


@pytest.mark.parametrize(("width", "height"), [(616, 490), (546, 546), (1848, 924), (112, 2982)])
def test_span_counts_agree_with_deepseek_recipe(width: int, height: int) -> None:
    """deepseek-recipe's own V4.1 image token count for an image already at its model size."""
    import deepseek_recipe as recipe

    one_placeholder = recipe.MultiModalData([recipe.ImageInfo(b"", width, height)]).image_token_adjustment()
    assert span_length(height // 14, width // 14, 3) == one_placeholder + 1


def test_prompt_images_rows_between_chunks() -> None:
    vectors = torch.arange(7.0)[:, None]
    images = PromptImages(((2, 3), (6, 4)), vectors)
    assert images.end == 10
    offsets, pieces = images.rows_between(3, 8)
    assert offsets == [0, 1, 3, 4] and torch.cat(pieces).flatten().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_preprocessing_gives_channel_major_patches_of_the_recipe_image(tmp_path: Path) -> None:
    import deepseek_recipe as recipe
    import numpy as np

    config = DeepseekV41VisionConfig()
    image = picture(90, 60, seed=1)
    got = preprocess_image(image, config)
    info = recipe.OpenCvImagePreprocessor().preprocess(image_bytes(image), recipe.PreprocessOptions("high", 8192, 512))
    pixels = np.asarray(Image.open(io.BytesIO(info.data)).convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    assert got.grid == (info.height // 14, info.width // 14)
    h, w = got.grid
    for k in (0, w + 2, h * w - 1):
        y, x = divmod(k, w)
        block = torch.from_numpy(pixels[y * 14:(y + 1) * 14, x * 14:(x + 1) * 14].copy()).permute(2, 0, 1)
        torch.testing.assert_close(got.patches[k], block.flatten(), rtol=0, atol=1e-6)
    path = tmp_path / "image.png"
    image.save(path)
    data_url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    for form in (str(path), path, path.read_bytes(), data_url):
        assert torch.equal(preprocess_image(form, config).patches, got.patches)
    for bad, message in (("https://example.com/a.png", "not fetched"), (str(tmp_path / "none.png"), "not a file"),
                         (b"not an image", "could not be preprocessed"), ("data:image/png,", "could not be"),
                         (42, "PIL image")):
        with pytest.raises(ImageInputError, match=message):
            preprocess_image(bad, config)


def test_image_rows_route_with_bias_vl() -> None:
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(5)
    c = SimpleNamespace(num_experts_per_tok=2, routed_scaling_factor=1.5, gate_temp=1.0)
    gate = SimpleNamespace(weight=torch.randn(6, 8, generator=gen), bias=torch.randn(6, generator=gen),
                           bias_vl=torch.randn(6, generator=gen) * 3)
    x = torch.randn(5, 8, generator=gen)
    rows = torch.tensor([1, 3])
    ops = KernelOps()
    weights, ids = route(ops, gate, c, x, rows)
    text_w, text_ids = ops.route_fp32(x, gate.weight, gate.bias, 2, 1.5, 1.0)
    vl_w, vl_ids = ops.route_fp32(x, gate.weight, gate.bias_vl, 2, 1.5, 1.0)
    for t in range(5):
        want_w, want_ids = (vl_w, vl_ids) if t in (1, 3) else (text_w, text_ids)
        assert torch.equal(ids[t], want_ids[t]) and torch.equal(weights[t], want_w[t])
    assert not torch.equal(text_ids[rows], vl_ids[rows]), "the two biases pick alike: the test would not see a mix-up"


def test_span_tokens_are_dead_for_the_engram(make_batch) -> None:
    """A span token's n-grams are all pad; the text after a span sees pad from the span on."""
    config = parse_deepseek_v41_config(make_tiny_v41_config()).text_config
    hasher = EngramHasher(config, KernelOps(), list(range(config.vocab_size)))
    history = torch.zeros(1, config.engram_max_ngram_size - 1, dtype=torch.int64)
    ids = torch.tensor([0, 5, 127, 127, 127, 9, 10])
    batch = make_batch([(ids, 0, 0, [0])])
    hashed = hasher.step(batch, history, ids, dead_rows=[2, 3, 4])
    pad = hasher.pad_id
    expected = torch.tensor([[0, pad, pad], [5, 0, pad], [pad] * 3, [pad] * 3, [pad] * 3, [9, pad, pad],
                             [10, 9, pad]])
    assert torch.equal(hashed, hasher.hash(expected))
    assert history[0].tolist() == [9, 10]
    hasher.step(make_batch([(ids[:5], 0, 0, [0])]), history, ids[:5], dead_rows=[2, 3, 4])
    assert history[0].tolist() == [DEAD, DEAD]


def make_tiny_v41_config() -> dict:
    from deepinfer_core.tools.tiny_v41_checkpoint import (
        TINY_V41_TEXT_CONFIG,
        TINY_V41_VISION_CONFIG,
    )

    return {"text_config": dict(TINY_V41_TEXT_CONFIG), "vision_config": dict(TINY_V41_VISION_CONFIG),
            "image_token_id": TINY_V41_TEXT_CONFIG["vocab_size"] - 1}


# ---------------------------------------------------------------------------------------------------
# The engine


def run_alone(checkpoint: Path, prompt: list[int], image: Image.Image, steps: int, make_batch) -> list[int]:
    """Greedy tokens of the model alone: a fresh model, its own span vectors, one prefill, then decodes."""
    config = parse_deepseek_v41_config(__import__("json").loads((checkpoint / "config.json").read_text()))
    model = DeepseekV41ForCausalLM(config, KernelOps(), torch.float32, CPU, kv_cache_dtype="bf16", vision=True)
    load_model_weights(model, checkpoint)
    model.bind_tokenizer_dir(checkpoint)
    patches = preprocess_image(image, config.vision_config)
    [vectors] = model.embed_images([patches.patches], [patches.grid])
    tokens, spans = expand_image_placeholders(prompt, config.image_token_id, [vectors.shape[0]])
    (first, length), = spans
    cache = DeepseekV41Cache(config, num_blocks=64, block_size=8, num_slots=1, dtype=torch.float32,
                             allocate=lambda shape, dtype: torch.randn(shape).to(dtype), kv_cache_dtype="bf16")
    table = list(range(64))
    rows = list(range(first, first + length))
    images = StepImages(torch.tensor(rows), rows, vectors)
    out = model(make_batch([(torch.tensor(tokens), 0, 0, table)]), cache, images=images)
    generated = [int(model.compute_logits(out.hidden[-1:]).argmax())]
    for _ in range(steps - 1):
        context = len(tokens) + len(generated) - 1
        out = model(make_batch([(torch.tensor(generated[-1:]), context, 0, table)]), cache)
        generated.append(int(model.compute_logits(out.hidden).argmax()))
    return generated


def test_engine_with_an_image_equals_the_model_alone(llm: LLM, vision_checkpoint: Path, make_batch,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """In a batch with a text request; the image span reaches the model in one step."""
    image_id = llm.model_config.image_token_id
    prompt = [0, 17, image_id, 23, 40]
    image = picture(50, 40, seed=2)
    seen = []
    forward = llm.model.forward

    def recording_forward(batch, cache, **kwargs):
        if kwargs.get("images") is not None:
            seen.append(len(kwargs["images"].rows_cpu))
        return forward(batch, cache, **kwargs)

    monkeypatch.setattr(llm.model, "forward", recording_forward)
    with_image, text, other_image = llm.generate(
        [{"prompt_token_ids": prompt, "images": [image]}, {"prompt_token_ids": [0, 30, 31, 32]},
         {"prompt_token_ids": prompt, "multi_modal_data": {"image": picture(50, 40, seed=9)}}],
        GREEDY, use_tqdm=False,
    )
    span = len(with_image.prompt_token_ids) - len(prompt) + 1
    assert with_image.prompt_token_ids.count(image_id) == span == span_length(*preprocess_image(
        image, llm.model_config.vision_config).grid, 3)
    assert seen == [2 * span], "both image spans arrive whole, in the first step"
    alone = run_alone(vision_checkpoint, prompt, image, GREEDY.max_tokens, make_batch)
    assert with_image.outputs[0].token_ids == alone
    assert with_image.outputs[0].logprobs != other_image.outputs[0].logprobs, "the image does not reach the model"
    assert len(text.outputs[0].token_ids) == GREEDY.max_tokens


def test_chat_with_image_parts_equals_generate(llm: LLM, tmp_path: Path) -> None:
    image = picture(40, 70, seed=4)
    path = tmp_path / "chat.png"
    image.save(path)
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    image_id = llm.model_config.image_token_id
    expected = llm.generate({"prompt_token_ids": [0, 4, 12, image_id, 13, 5], "images": [image]}, GREEDY,
                            use_tqdm=False)[0]
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image", "image": image},
                 {"type": "image", "image": str(path)}):
        content = [{"type": "text", "text": "t12 "}, part, {"type": "text", "text": " t13"}]
        [got] = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
        assert got.prompt_token_ids == expected.prompt_token_ids
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    [text] = llm.generate({"prompt": "t0 t4 t12 <｜deepseek_image｜> t13 t5", "images": [image]}, GREEDY,
                          use_tqdm=False)
    assert text.prompt_token_ids == expected.prompt_token_ids and text.prompt == "t0 t4 t12 <｜deepseek_image｜> t13 t5"


def test_recipe_encoding_puts_one_image_token_per_image(vision_checkpoint: Path, tmp_path: Path) -> None:
    """Without a chat template, deepseek-recipe renders the conversation; each image is one image token."""
    from tokenizers import AddedToken, Tokenizer

    from deepinfer_core.engine.chat import split_images

    tokenizer = Tokenizer.from_file(str(vision_checkpoint / "tokenizer.json"))
    roles = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "</think>", "<think>", "<｜end▁of▁sentence｜>")
    tokenizer.add_special_tokens([AddedToken(t) for t in roles])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    token = "<｜deepseek_image｜>"
    messages, images = split_images([{"role": "user", "content": [
        {"type": "text", "text": "t7 "}, {"type": "image", "image": b"a"}, {"type": "image", "image": b"b"}]}], token)
    assert images == [b"a", b"b"]

    class NoTemplate:
        chat_template = None

    ids = encode_conversation(messages, tokenizer=NoTemplate(), checkpoint_dir=tmp_path, model_type="deepseek_v41",
                              thinking_mode=False, reasoning_effort=None, image_token=token)
    assert ids.count(tokenizer.token_to_id(token)) == 2 and 7 in ids


def test_bad_image_fails_alone_and_names_its_request(llm: LLM) -> None:
    image_id = llm.model_config.image_token_id
    good = {"prompt_token_ids": [0, 17, image_id, 23], "images": [picture(30, 30, seed=6)]}
    bad_requests = [
        ({"prompt_token_ids": [0, image_id, 9], "images": [b"\x89PNG broken"]}, "image 0: the image could not"),
        ({"prompt_token_ids": [0, image_id, 9], "images": []}, "no image was given"),
        ({"prompt_token_ids": [0, 9], "images": [picture(30, 30, seed=7)]}, r"0 image token\(s\) .* 1 image"),
        ({"prompt_token_ids": [0, image_id, 9], "images": ["/no/such/file.png"]}, "not a file"),
    ]
    for bad, message in bad_requests:
        with pytest.raises(InvalidRequestError, match=f"request 1: .*{message}"):
            llm.generate([good, bad, {"prompt_token_ids": [0, 8]}], GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished()
    outputs = llm.generate([good, {"prompt_token_ids": [0, 8]}], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [GREEDY.max_tokens] * 2


def test_image_spans_must_fit_one_prefill_step(vision_checkpoint: Path) -> None:
    small = LLM(str(vision_checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=64,
                block_size=8, max_num_batched_tokens=64)
    image_id = small.model_config.image_token_id
    with pytest.raises(InvalidRequestError, match="request 0: .*max_num_batched_tokens 64"):
        small.generate({"prompt_token_ids": [0, image_id], "images": [picture(30, 30, seed=8)]}, GREEDY,
                       use_tqdm=False)


def test_models_without_vision_refuse_images(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """V4 has no vision tower; a V4.1 checkpoint with a vision_config but no vision weights (like the
    golden fixtures) loads as a text model and refuses images."""
    image = picture(30, 30, seed=10)
    v4 = LLM(str(tiny_checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=24,
             max_model_len=256)
    with pytest.raises(InvalidRequestError, match="request 0: the model .*deepseek_v4.* has no vision tower"):
        v4.generate({"prompt_token_ids": [5, 6], "images": [image]}, GREEDY, use_tqdm=False)
    text_only = make_tiny_v41_checkpoint(tmp_path / "text-only", vision=False)
    v41 = LLM(str(text_only), accelerator="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=64, block_size=8)
    assert v41.model.vision is None
    with pytest.raises(InvalidRequestError, match="request 0: .*vision_config but no vision weights"):
        v41.generate({"prompt_token_ids": [0, 127, 6], "images": [image]}, GREEDY, use_tqdm=False)
    [text] = v41.generate({"prompt_token_ids": [0, 5, 6]}, GREEDY, use_tqdm=False)
    assert len(text.outputs[0].token_ids) == GREEDY.max_tokens
