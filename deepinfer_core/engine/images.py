"""Images in requests (DeepSeek-V4.1, MODEL_SPEC_V41 §11): loading, preprocessing, and span placement.

An image is given as a PIL image, a local file path, encoded bytes, or a `data:` URL (no network: an
http(s) URL is refused). deepseek-recipe's image preprocessor (`OpenCvImagePreprocessor`, the release's
sizing rules: multiples of the 14-pixel patch, at least `min_pixels`, at most `max_image_tokens`
span tokens) resizes it; the result is cut into channel-major patches [h*w, 3*p*p] normalised to
[-1, 1] by (x/255 - 0.5) / 0.5 (the normalisation of third-party ports of the reference [docs]; no
reference run of the vision path exists).

In a prompt each image is ONE image token (the config's `image_token_id`, `<｜deepseek_image｜>` in the
release tokenizer) where the image goes; `expand_image_placeholders` widens each into the image's span
(`image_span.span_length` positions, every one carrying the image token id).
"""

from __future__ import annotations

import base64
import io
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.models.deepseek_v41.config import DeepseekV41VisionConfig
from deepinfer_core.models.deepseek_v41.image_span import span_length

__all__ = [
    "ImageInputError",
    "ImagePatches",
    "PendingImages",
    "PromptImages",
    "checkpoint_has_vision",
    "expand_image_placeholders",
    "image_bytes",
    "preprocess_image",
    "prompt_images",
]

# deepseek-recipe refuses larger inputs (ImageDimensionsTooLarge); "low" detail shrinks to this edge first.
MAX_DIMENSION_PX = 8192
LOW_DETAIL_MAX_DIMENSION_PX = 512
VISION_PREFIXES = ("vision.", "aligner.", "image_")


class ImageInputError(ValueError):
    """An image cannot be read or preprocessed; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ImagePatches:
    patches: torch.Tensor    # [h*w, 3*p*p] float32, row-major over the patch grid, channel-major per patch
    grid: tuple[int, int]    # (h, w) patches


@dataclass(frozen=True, slots=True)
class PendingImages:
    """A validated request's images before the vision tower ran: their spans in the prompt and patches."""

    spans: tuple[tuple[int, int], ...]
    images: list[ImagePatches]

    @property
    def end(self) -> int:
        first, length = self.spans[-1]
        return first + length


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A request's image spans and their vectors: span k covers prompt positions spans[k][0] ..
    spans[k][0] + spans[k][1] - 1; `vectors` [sum of lengths, D] holds the spans' vectors in order (device)."""

    spans: tuple[tuple[int, int], ...]
    vectors: torch.Tensor

    @property
    def end(self) -> int:
        """The position after the last span: a prefill chunk starting at 0 must reach it (one-chunk images)."""
        first, length = self.spans[-1]
        return first + length

    def rows_between(self, start: int, stop: int) -> tuple[list[int], list[torch.Tensor]]:
        """Span positions in [start, stop) as offsets from `start`, and their vectors (slices, in order)."""
        offsets, pieces, taken = [], [], 0
        for first, length in self.spans:
            lo, hi = max(first, start), min(first + length, stop)
            if lo < hi:
                offsets.extend(range(lo - start, hi - start))
                pieces.append(self.vectors[taken + lo - first: taken + hi - first])
            taken += length
        return offsets, pieces


def image_bytes(image: Any) -> bytes:
    """The encoded bytes of a PIL image, a local path, bytes, or a `data:` URL."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, Path) or (isinstance(image, str) and not image.startswith("data:")):
        text = str(image)
        if text.startswith(("http://", "https://")):
            raise ImageInputError(f"image URL {text[:80]!r}: remote images are not fetched; pass a local path, "
                                  "bytes, a PIL image or a data: URL")
        path = Path(text)
        if not path.is_file():
            raise ImageInputError(f"image path {text[:200]!r} is not a file")
        return path.read_bytes()
    if isinstance(image, str):
        return _data_url_bytes(image)
    if hasattr(image, "save") and hasattr(image, "convert"):  # a PIL image
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
        return buffer.getvalue()
    raise ImageInputError(f"an image is a PIL image, a local path, bytes or a data: URL; got {type(image).__name__}")


def _data_url_bytes(url: str) -> bytes:
    header, comma, body = url.partition(",")
    if not comma:
        raise ImageInputError(f"data URL {url[:60]!r}... has no ',' before its data")
    try:
        if header.endswith(";base64"):
            return base64.b64decode(body, validate=True)
        return urllib.parse.unquote_to_bytes(body)
    except ValueError as err:
        raise ImageInputError(f"data URL {url[:60]!r}... does not decode: {err}") from err


def preprocess_image(image: Any, config: DeepseekV41VisionConfig, detail: str = "high") -> ImagePatches:
    """Resize with deepseek-recipe and cut into patches. Raises ImageInputError for an unreadable or
    unsupported image, or sizes that do not fit the config's patch grid."""
    import deepseek_recipe as recipe
    import numpy as np
    from PIL import Image

    data = image_bytes(image)
    try:
        info = recipe.OpenCvImagePreprocessor().preprocess(
            data, recipe.PreprocessOptions(detail, MAX_DIMENSION_PX, LOW_DETAIL_MAX_DIMENSION_PX)
        )
        resized = Image.open(io.BytesIO(info.data)).convert("RGB")
    except (recipe.ImageError, OSError, ValueError) as err:
        kind = getattr(err, "kind", type(err).__name__)
        raise ImageInputError(f"the image could not be preprocessed ({kind}): {err}") from err
    p = config.patch_size
    width, height = resized.size
    if width % p or height % p:
        raise ImageInputError(f"deepseek-recipe sized the image {width}x{height}, not a multiple of the config's "
                              f"patch_size {p}; it sizes for the release geometry (patch 14)")
    grid = (height // p, width // p)
    length = span_length(*grid, config.downsample_ratio)
    if length > config.max_image_tokens:
        raise ImageInputError(f"the image needs {length} span tokens, more than the config's max_image_tokens "
                              f"{config.max_image_tokens}")
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32).copy()) / 255.0
    pixels = (pixels - 0.5) / 0.5                                   # [H, W, 3]
    patches = pixels.view(grid[0], p, grid[1], p, 3).permute(0, 2, 4, 1, 3).reshape(grid[0] * grid[1], 3 * p * p)
    return ImagePatches(patches.contiguous(), grid)


def expand_image_placeholders(
    token_ids: list[int], image_token_id: int, lengths: list[int]
) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """Widen the k-th image token of `token_ids` into lengths[k] image tokens. Returns the new ids and
    each span's (first position, length). The caller checks that the counts agree."""
    expanded: list[int] = []
    spans = []
    remaining = iter(lengths)
    for token in token_ids:
        if token == image_token_id:
            length = next(remaining)
            spans.append((len(expanded), length))
            expanded.extend([image_token_id] * length)
        else:
            expanded.append(token)
    return expanded, tuple(spans)


def prompt_images(
    prompt: Any, token_ids: list[int], model: Any, model_config: Any
) -> tuple[list[int], PendingImages | None]:
    """The prompt's token ids with each image token widened into its image's span, and the images.

    Images come from a dict prompt's "images" (one or a list) or "multi_modal_data": {"image": ...}.
    Raises ImageInputError when the model takes no images, the image tokens and images disagree in
    number, or an image is unreadable.
    """
    images = _images_of(prompt)
    image_token_id = getattr(model_config, "image_token_id", None)
    count = token_ids.count(image_token_id) if image_token_id is not None else 0
    if not images:
        if count and getattr(model, "vision", None) is not None:
            raise ImageInputError(f"the prompt holds {count} image token(s) (id {image_token_id}) but no image "
                                  "was given; pass one image per image token in 'images'")
        return token_ids, None
    if getattr(model, "vision", None) is None:
        raise ImageInputError(_no_vision_reason(model_config))
    if count != len(images):
        raise ImageInputError(f"the prompt holds {count} image token(s) (id {image_token_id}) but {len(images)} "
                              "image(s) were given; put one image token where each image goes")
    patches = []
    for k, image in enumerate(images):
        try:
            patches.append(preprocess_image(image, model_config.vision_config))
        except ImageInputError as err:
            raise ImageInputError(f"image {k}: {err}") from err
    ratio = model_config.vision_config.downsample_ratio
    expanded, spans = expand_image_placeholders(token_ids, image_token_id,
                                                [span_length(*p.grid, ratio) for p in patches])
    return expanded, PendingImages(spans, patches)


def _images_of(prompt: Any) -> list[Any]:
    if not isinstance(prompt, dict):
        return []
    images = prompt.get("images")
    if images is None:
        images = (prompt.get("multi_modal_data") or {}).get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _no_vision_reason(model_config: Any) -> str:
    model_type = getattr(model_config, "model_type", type(model_config).__name__)
    if getattr(model_config, "vision_config", None) is None:
        return f"the model ({model_type}) has no vision tower, so it takes no images"
    return (f"the checkpoint ({model_type}) has a vision_config but no vision weights (`vision.*`, `aligner.*`, "
            "`image_*`), so it takes no images")


def checkpoint_has_vision(checkpoint_dir: Path) -> bool:
    """Whether the checkpoint's safetensors hold vision tower weights (headers only)."""
    from deepinfer_core.weights.safetensors_io import checkpoint_shards, read_header

    return any(t.name.startswith(VISION_PREFIXES) for shard in checkpoint_shards(checkpoint_dir)
               for t in read_header(shard))
