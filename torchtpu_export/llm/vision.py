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
import functools

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
    ``encoder``, ``adapter`` and ``embedder`` modules, the image size the encoder takes, ``hidden`` (D),
    ``marker`` (the text a chat template puts where an image is, where LiteRT-LM puts its rows) and the
    LlmMetadata's model type for the family (``model_type``, a field of ``LlmModelType``, and its
    ``fields``: a token's as its text)."""

    family: str
    text: torch.nn.Module
    encoder: torch.nn.Module
    adapter: torch.nn.Module
    embedder: torch.nn.Module
    height: int
    width: int
    hidden: int
    marker: str
    image_tokens: int  # rows the adapter gives per image
    model_type: str
    fields: dict
    # [D]: the adapter's closing row (Gemma 3's <end_of_image>), text to the model; with it an image's rows
    # attend to one another (LiteRT-LM's vision-bidirectional mask), the closing row kept causal
    # (llm.step.CacheStep)
    image_end: torch.Tensor | None = None
    model: torch.nn.Module | None = None  # the whole VLM (the reference of the tpu target's image check)
    notes: tuple = ()  # what the bundle does otherwise than the family's image processor, said at export
    # where the prompt's tokens say the image is (the tpu target's steps merge the rows there, as transformers
    # does): the token id of each image row, the chat template's marker and the text the processor puts for it
    image_token_id: int = -1
    expansion: tuple = ("", "")
    bidirectional: bool = False  # an image's rows attend to one another (Gemma 3's token_type_ids)
    resample: str = "bilinear"  # the image processor's resize filter


class int32_buffers:
    """Within it, ``module``'s int64 buffers (a vision tower's ``position_ids``) are int32: a program's int64
    weights reach a jitted caller without x64 (the serving engine's) as int32, which the program refuses."""

    def __init__(self, module):
        self.found = [(m, name, b) for m in module.modules() for name, b in m.named_buffers(recurse=False)
                      if b is not None and b.dtype == torch.int64]

    def __enter__(self):
        for m, name, b in self.found:
            setattr(m, name, b.to(torch.int32))
        return self

    def __exit__(self, *exc):
        for m, name, b in self.found:
            setattr(m, name, b)


class ImageRows(torch.nn.Module):
    """``images [1, H, W, 3]`` in [0, 1] -> ``embeddings [1, R, D]``: the encoder then the adapter, without the
    adapter's closing row (``VisionParts.image_end``), which the prompt's own token gives where the steps take
    tokens (the tpu target's ``vision`` program)."""

    def __init__(self, parts: "VisionParts"):
        super().__init__()
        self.encoder = parts.encoder
        adapter = parts.adapter  # its projection alone (Gemma3Adapter's projector, a Connector's connector)
        self.project = adapter.projector if isinstance(adapter, Gemma3Adapter) else adapter.connector

    def forward(self, images):
        return {"embeddings": self.project(self.encoder(images)["features"])}


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
    if not isinstance(rescale, (int, float)) or isinstance(rescale, bool) or abs(rescale * 255 - 1) > 1e-6:
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
    start = _token(tokenizer, config, "boi_token_index", name)
    end_text = _token(tokenizer, config, "eoi_token_index", name)
    size = _entry(processor, "size")
    height, width = size.get("height", vision.image_size), size.get("width", vision.image_size)
    _check_size(name, (height, width), vision.image_size)
    notes = (_resize_note("bilinearly", height, width),)
    with torch.no_grad():
        end = embed(torch.tensor([[config.eoi_token_index]]))[0, 0].detach().clone()
    fields = dict(start_of_image_token=start, end_of_image_token=end_text, image_tensor_height=height,
                  image_tensor_width=width)
    soft = _token(tokenizer, config, "image_token_index", name)
    # Gemma3Processor's full_image_sequence for the template's <start_of_image>
    sequence = f"\n\n{start}{soft * config.mm_tokens_per_image}{end_text}\n\n"
    return VisionParts("gemma3", _text_model(vlm, core.language_model, vlm.lm_head),
                       ImageEncoder(core.vision_tower, mean, std).eval(),
                       Gemma3Adapter(core.multi_modal_projector, embed, config.eoi_token_index).eval(),
                       Embedder(embed).eval(), height, width, config.text_config.hidden_size, start,
                       config.mm_tokens_per_image + 1, "gemma3", fields, end, notes,
                       image_token_id=config.image_token_index, expansion=(start, sequence), bidirectional=True,
                       resample=_resample(processor, "bilinear"))


class Connector(torch.nn.Module):
    """``soft_tokens`` (the encoder's features) -> ``embeddings [1, N, D]`` through ``connector`` (Idefics3's and
    SmolVLM's: a pixel shuffle and a projection)."""

    def __init__(self, connector):
        super().__init__()
        self.connector = connector

    def forward(self, soft_tokens):
        return {"embeddings": self.connector(soft_tokens)}


def _smolvlm(vlm, processor: dict, name: str, tokenizer) -> VisionParts:
    """SmolVLM / Idefics3, one image unsplit (``do_image_splitting`` false): LiteRT-LM's generic model type puts
    ``<fake_token_around_image><global-img>``, the image's rows and ``<fake_token_around_image>`` where the
    template says ``<image>``, as the processor expands it."""
    core, config = vlm.model, vlm.config
    vision = config.vision_config
    if processor.get("do_image_splitting", True):
        raise InputError(f"{name}: its image processor splits an image into tiles (do_image_splitting), each an "
                         "image of its own in the prompt; LiteRT-LM gives the encoder the whole image",
                         hint="set do_image_splitting false in preprocessor_config.json")
    mean, std = _normalization(processor, name)
    edge = _entry(processor, "max_image_size").get("longest_edge", vision.image_size)
    _check_size(name, (edge, edge), vision.image_size)
    tokens = {}
    for text in ("<fake_token_around_image>", "<global-img>", "<image>"):
        if tokenizer is None or _token_id(tokenizer, text) is None:
            raise InputError(f"{name}: its tokenizer has no {text} token, which a SmolVLM prompt puts around an "
                             "image")
        tokens[text] = text
    per_side = vision.image_size // vision.patch_size
    rows = per_side * per_side // (config.scale_factor ** 2)
    fields = dict(image_enabled=True, delimiter_regex="(<image>)", image_token_regex="<image>",
                  image_prefix="<fake_token_around_image>", start_of_image_token="<global-img>",
                  image_suffix="<fake_token_around_image>", image_tensor_height=edge, image_tensor_width=edge)
    embed = core.text_model.embed_tokens
    # Idefics3Processor's text for one image kept whole
    sequence = "<fake_token_around_image><global-img>" + "<image>" * rows + "<fake_token_around_image>"
    return VisionParts(config.model_type, _text_model(vlm, core.text_model, vlm.lm_head),
                       ImageEncoder(core.vision_model, mean, std).eval(), Connector(core.connector).eval(),
                       Embedder(embed).eval(), edge, edge, config.text_config.hidden_size, "<image>", rows,
                       "generic_model", fields, None, (_resize_note("with Lanczos", edge, edge),),
                       image_token_id=config.image_token_id, expansion=("<image>", sequence),
                       resample=_resample(processor, "lanczos"))


# PIL's resample codes, as image processor configs save them
_RESAMPLE = {1: "lanczos", 2: "bilinear", 3: "bicubic"}


def _resample(processor: dict, default: str) -> str:
    """The image processor's resize filter by name (``torchtpu_export.images.RESAMPLE``): its ``resample``
    code, or the family's default."""
    return _RESAMPLE.get(processor.get("resample"), default)


def _entry(processor: dict, key: str) -> dict:
    value = processor.get(key) or {}
    if not isinstance(value, dict):
        raise InputError(f"the image processor's {key} must be a JSON object, got {type(value).__name__}")
    return value


def _check_size(name: str, size: tuple, tower: int) -> None:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in size) or tuple(size) != (tower, tower):
        raise InputError(f"{name}: its image processor resizes to {size[0]}x{size[1]}, its vision tower takes "
                         f"{tower}x{tower}")


def _resize_note(how: str, height: int, width: int) -> str:
    return (f"LiteRT-LM resizes an image with a Catmull-Rom filter, transformers' processor {how}: an image of "
            f"another size than {height}x{width} gives the encoder slightly other pixels")


def _token(tokenizer, config, attr: str, name: str) -> str:
    token_id = getattr(config, attr, None)
    text = _token_text(tokenizer, token_id)
    if text is None:
        raise InputError(f"{name}: its tokenizer has no token {token_id} ({attr}), which marks an image")
    return text


def _token_id(tokenizer, text: str):
    return _parsed(tokenizer.json).token_to_id(text)


def _token_text(tokenizer, token_id) -> str | None:
    if tokenizer is None or not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        return None
    return _parsed(tokenizer.json).id_to_token(token_id)


@functools.lru_cache(maxsize=1)
def _parsed(tokenizer_json: str):
    """The tokenizer parsed once for the image tokens' lookups (a 33 MB Gemma tokenizer.json takes seconds)."""
    from tokenizers import Tokenizer
    return Tokenizer.from_str(tokenizer_json)


# HF model_type -> how its parts are found
FAMILIES = {"gemma3": _gemma3, "idefics3": _smolvlm}


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
    parts = FAMILIES[family](model, processor or {}, name, tokenizer)
    parts.model = model
    return parts


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


def _compare(what: str, ours, ref) -> float:
    """The max error of ``ours`` over ``ref``'s scale; NumericsError above :data:`VISION_TOLERANCE`."""
    import numpy as np

    from ..errors import NumericsError
    ref = np.asarray(ref, np.float64)
    error = float(np.abs(np.asarray(ours, np.float64) - ref).max()) / (float(np.abs(ref).max()) or 1.0)
    if error > VISION_TOLERANCE:
        raise NumericsError(f"the exported vision {what} differs from transformers' on a probe image: max error "
                            f"{error:.2e} of its output's scale", hint="report it with --debug")
    return error


def check_programs(parts: VisionParts, programs: dict) -> dict:
    """The exported encoder and adapter against torch on a seeded image (and the adapter on the torch
    encoder's features): ``{"encoder_error", "adapter_error"}`` over each output's scale; a program off by
    more than :data:`VISION_TOLERANCE` is a NumericsError."""
    image = sample_image(parts, seed=1)
    with torch.no_grad():
        features = parts.encoder(image)["features"]
        rows = parts.adapter(features)["embeddings"]
    report = {}
    for what, sig, feed, ref in (("encoder", "vision_encoder", {"images": image.numpy()}, features),
                                 ("adapter", "vision_adapter", {"soft_tokens": features.numpy()}, rows)):
        ours = next(iter(_outputs(programs[sig], sig, **feed).values()))
        report[f"{what}_error"] = _compare(what, ours, ref.double().numpy())
    return report


def _reference_logits(parts: VisionParts, ids: list, image):
    """transformers' whole VLM on ``ids`` (its image tokens in place) and ``image`` ([1, H, W, 3] in [0, 1]):
    the last position's logits, as the family's processor feeds it (Gemma 3's token_type_ids)."""
    enc = parts.encoder
    pixels = (image.permute(0, 3, 1, 2) - enc.mean) / enc.std
    tokens = torch.tensor([ids])
    kw = {"token_type_ids": (tokens == parts.image_token_id).to(torch.long)} if parts.family == "gemma3" else {}
    if parts.family != "gemma3":  # Idefics3: [batch, images, 3, H, W]
        pixels = pixels[:, None]
    with torch.no_grad():
        return parts.model(input_ids=tokens, pixel_values=pixels, **kw).logits[0, -1].double().numpy()


def check_image_steps(parts: VisionParts, program, tolerance: float) -> dict:
    """The tpu target's image path against transformers' VLM: the ``vision`` program's rows of a seeded image
    (against torch), merged by a ``prefill_image_<N>`` step into a probe prompt, then a decode step; its
    next-token logits against the whole VLM's. NumericsError past ``tolerance`` (of the logits' scale)."""
    import numpy as np

    from ..errors import NumericsError
    from .plan import VISION, StepPlan
    from .host import HostLoop
    image = sample_image(parts, seed=2)
    rows = np.asarray(_outputs(program, VISION, images=image.numpy())["embeddings"])
    with torch.no_grad():
        rows_error = _compare("image rows", rows, ImageRows(parts)(image)["embeddings"].double().numpy())
    ids = [5, 9, *[parts.image_token_id] * rows.shape[1], 7, 11, 13]
    n = next((k for k in StepPlan.of(program.signatures).lengths if k >= len(ids) - 1), None)
    if n is None:
        return {"rows_error": rows_error, "steps_checked": False, "why": "no prefill length holds an image"}
    aligned = np.zeros((1, n, rows.shape[2]), np.float32)
    where = [i for i, t in enumerate(ids[:-1]) if t == parts.image_token_id]
    aligned[0, where] = rows[0]
    loop = HostLoop(program)
    loop.step(StepPlan.prefill_image(n), ids[:-1], {"image_rows": aligned}, n=n)
    ours = np.asarray(loop.decode(ids[-1]), np.float64)
    ref = _reference_logits(parts, ids, image)
    scale = float(np.abs(ref).max()) or 1.0
    error = float(np.abs(ours - ref).max()) / scale
    if error > tolerance:
        raise NumericsError(f"the exported image prefill's next-token logits differ from transformers' VLM on a "
                            f"probe image: max error {error:.2e} of the logits' scale",
                            hint="report it with --debug")
    return {"rows_error": rows_error, "steps_error": error}
