"""Vision-language models: a VLM's parts as the programs an on-device runtime runs beside its language model.

LiteRT-LM (``runtime/executor/vision_litert_compiled_model_executor.cc``, ``embedding_lookup_text.cc``,
``gemma3_data_processor.cc``) runs an image through two models and merges the result into the prompt:

- the **vision encoder**, ``images [1, H, W, 3]`` float32 RGB in [0, 1] (the file decoded, resized to the
  metadata's ``image_tensor_height`` x ``image_tensor_width`` and divided by 255; nothing else), one output:
  the image processor's normalization and the NCHW layout the tower takes are inside the program;
- the **vision adapter**, the encoder's output to ``[1, N, D]``: N rows put into the prompt where the image
  is (Gemma 3: the projector's soft tokens, then ``<end_of_image>``'s embedding, which the runtime leaves to
  the adapter);
- with images, the language model takes ``embeddings [1, T, D]`` instead of tokens, and an **embedder**
  gives each text token's (``token_ids [1, 1]`` int32 -> ``[1, 1, D]``, the model's embedding scale inside).

:func:`vision_parts` finds them in a transformers VLM; a family not in :data:`FAMILIES` is refused."""
from __future__ import annotations

import dataclasses

import torch

from ..errors import InputError


class ImageEncoder(torch.nn.Module):
    """``images [1, H, W, 3]`` in [0, 1] -> ``features`` (the tower's last hidden state): the image processor's
    ``(x - mean) / std`` and the tower's NCHW layout inside."""

    def __init__(self, tower, mean, std):
        super().__init__()
        self.tower = tower
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def forward(self, images):
        pixels = (images.permute(0, 3, 1, 2) - self.mean) / self.std
        return {"features": self.tower(pixel_values=pixels).last_hidden_state}


class Gemma3Adapter(torch.nn.Module):
    """``soft_tokens`` (the encoder's features) -> ``embeddings [1, N + 1, D]``: Gemma 3's projector (pooled to
    ``mm_tokens_per_image`` rows), then the ``<end_of_image>`` token's embedding, as the processor's
    ``<image_soft_token> x N <end_of_image>`` reads in transformers."""

    def __init__(self, projector, embed, end_id: int):
        super().__init__()
        self.projector, self.embed = projector, embed
        self.register_buffer("end", torch.tensor([[end_id]], dtype=torch.long), persistent=False)

    def forward(self, soft_tokens):
        rows = self.projector(soft_tokens)
        return {"embeddings": torch.cat([rows, self.embed(self.end).to(rows.dtype)], dim=1)}


class Embedder(torch.nn.Module):
    """``token_ids [1, T]`` int32 -> ``embeddings [1, T, D]``: the language model's own embedding (Gemma's
    sqrt(hidden) scale included)."""

    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, token_ids):
        return {"embeddings": self.embed(token_ids.to(torch.long))}


@dataclasses.dataclass
class VisionParts:
    """A VLM split for export: ``text`` (its language model as a causal LM: the same modules), the
    ``encoder``, ``adapter`` and ``embedder`` modules, the image size the encoder takes, the image tokens
    the runtime's prompt names (``start``, ``end``: token text), and ``hidden`` (D)."""

    family: str
    text: torch.nn.Module
    encoder: torch.nn.Module
    adapter: torch.nn.Module
    embedder: torch.nn.Module
    height: int
    width: int
    hidden: int
    start: str
    end: str
    image_tokens: int  # rows the adapter gives per image (its soft tokens and the end-of-image row)
    image_end: torch.Tensor | None = None  # [D]: the adapter's last row, text to the model (llm.step.CacheStep)
    notes: tuple = ()  # what the bundle does otherwise than the family's image processor, said at export


def _text_model(vlm, language_model, lm_head):
    """The VLM's language model and head as a causal LM of its text config (the same modules, no copy)."""
    from transformers import AutoModelForCausalLM
    config = language_model.config
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    lm.model, lm.lm_head, lm.config = language_model, lm_head, config
    lm.generation_config = vlm.generation_config
    return lm.eval()


# what an image processor config may ask that the bundle's encoder cannot do, and why
_UNSUPPORTED_PROCESSING = {
    "do_pan_and_scan": "pan and scan (extra crops of a wide image, each an image of its own in the prompt): "
                       "LiteRT-LM gives the encoder the whole image, resized",
}


def _normalization(processor: dict, name: str):
    """The image processor's (mean, std) on [0, 1] pixels, or InputError for what the encoder cannot match."""
    for key, why in _UNSUPPORTED_PROCESSING.items():
        if processor.get(key):
            raise InputError(f"{name}: its image processor asks for {why}", hint=f"set {key} false in "
                             "preprocessor_config.json to export the model as LiteRT-LM runs it")
    rescale = processor.get("rescale_factor", 1 / 255) if processor.get("do_rescale", True) else 1.0
    if abs(float(rescale) * 255 - 1) > 1e-6:
        raise InputError(f"{name}: its image processor scales pixels by {rescale}; LiteRT-LM gives the encoder "
                         "pixels / 255")
    mean, std = processor.get("image_mean", [0.5] * 3), processor.get("image_std", [0.5] * 3)
    if not processor.get("do_normalize", True):
        mean, std = [0.0] * 3, [1.0] * 3
    try:
        mean, std = [float(v) for v in mean], [float(v) for v in std]
    except (TypeError, ValueError):
        raise InputError(f"{name}: image_mean and image_std must be numbers") from None
    if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
        raise InputError(f"{name}: image_mean and image_std must be 3 numbers each, image_std positive")
    return mean, std


def _gemma3(vlm, processor: dict, name: str, tokenizer) -> VisionParts:
    core, config = vlm.model, vlm.config
    vision = config.vision_config
    mean, std = _normalization(processor, name)
    embed = core.language_model.embed_tokens
    tokens = {}
    for key, attr in (("start", "boi_token_index"), ("end", "eoi_token_index")):
        token_id = getattr(config, attr, None)
        text = _token_text(tokenizer, token_id)
        if text is None:
            raise InputError(f"{name}: its tokenizer has no token {token_id} ({attr}), the image's "
                             f"{'start' if key == 'start' else 'end'} token")
        tokens[key] = text
    size = processor.get("size") or {}
    height, width = size.get("height", vision.image_size), size.get("width", vision.image_size)
    if (height, width) != (vision.image_size, vision.image_size):
        raise InputError(f"{name}: its image processor resizes to {height}x{width}, its vision tower takes "
                         f"{vision.image_size}x{vision.image_size}")
    notes = ("LiteRT-LM resizes an image with a Catmull-Rom filter, transformers' processor bilinearly: an "
             f"image of another size than {height}x{width} gives the encoder slightly other pixels",)
    with torch.no_grad():
        end = embed(torch.tensor([[config.eoi_token_index]]))[0, 0].detach().clone()
    return VisionParts("gemma3", _text_model(vlm, core.language_model, vlm.lm_head),
                       ImageEncoder(core.vision_tower, mean, std).eval(),
                       Gemma3Adapter(core.multi_modal_projector, embed, config.eoi_token_index).eval(),
                       Embedder(embed).eval(), height, width, config.text_config.hidden_size, tokens["start"],
                       tokens["end"], config.mm_tokens_per_image + 1, end, notes)


def _token_text(tokenizer, token_id) -> str | None:
    if tokenizer is None or not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_str(tokenizer.json).id_to_token(token_id)


# HF model_type -> how its parts are found
FAMILIES = {"gemma3": _gemma3}


def is_vision_family(config: dict) -> bool:
    """Whether a raw config.json is a VLM of a family :func:`vision_parts` exports."""
    return config.get("model_type") in FAMILIES and config.get("vision_config") is not None


def vision_parts(model, processor: dict | None, name: str, tokenizer) -> VisionParts:
    """The parts of ``model`` (a transformers VLM of a family in :data:`FAMILIES`), ``processor`` its image
    processor's config (``preprocessor_config.json``; None: the family's defaults)."""
    family = getattr(model.config, "model_type", None)
    if family not in FAMILIES:
        raise InputError(f"{name} is a {family} vision-language model; exported VLM families: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[family](model, processor or {}, name, tokenizer)


def sample_image(parts: VisionParts, seed: int = 0):
    """A seeded image as the encoder takes it: ``[1, H, W, 3]`` float32 in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(1, parts.height, parts.width, 3, generator=gen)


def _outputs(program, sig: str, **feed) -> dict:
    outs = program(signature_name=sig, **feed)
    if not isinstance(outs, dict):
        outs = dict(zip([o.name for o in program.outputs(sig)], outs if isinstance(outs, tuple) else [outs]))
    return outs


def program_embed(embedder):
    """Token ids ``[1, n]`` -> ``[1, n, D]`` through the exported embedder, one token per call (its
    signature takes ``[1, 1]``, as LiteRT-LM calls it)."""
    import numpy as np

    def embed(ids):
        rows = [_outputs(embedder, "embedder", token_ids=np.array([[t]], np.int32))["embeddings"][0, 0]
                for t in np.asarray(ids).reshape(-1).tolist()]
        return np.stack(rows)[None].astype(np.float32)
    return embed


VISION_TOLERANCE = 1e-4  # the encoder's and adapter's programs against torch: max error over the output's scale


def check_programs(parts: VisionParts, programs: dict) -> dict:
    """The exported encoder and adapter against torch on a seeded image (and the adapter on the torch
    encoder's features): ``{"encoder_error", "adapter_error"}`` over each output's scale; a program off by
    more than :data:`VISION_TOLERANCE` is a NumericsError."""
    import numpy as np

    from ..errors import NumericsError
    image = sample_image(parts, seed=1)
    with torch.no_grad():
        features = parts.encoder(image)["features"]
        rows = parts.adapter(features)["embeddings"]
    report = {}
    for what, sig, feed, ref in (("encoder", "vision_encoder", {"images": image.numpy()}, features),
                                 ("adapter", "vision_adapter", {"soft_tokens": features.numpy()}, rows)):
        ours = next(iter(_outputs(programs[sig], sig, **feed).values()))
        ref = ref.double().numpy()
        error = float(np.abs(np.asarray(ours, np.float64) - ref).max()) / (float(np.abs(ref).max()) or 1.0)
        if error > VISION_TOLERANCE:
            raise NumericsError(f"the exported vision {what} differs from transformers' on a probe image: max error "
                                f"{error:.2e} of its output's scale", hint="report it with --debug")
        report[f"{what}_error"] = error
    return report
