"""Images a user gives a vision-language model (a file for LiteRT-LM, a data URL in an OpenAI request), read
whole by Pillow within size bounds before anything else sees them: a damaged or oversized image is one
message (InputError), never a decoder's crash or a gigabyte allocation. No torch here.

What an image may cost is counted from its header before it is decoded: its decoded size (width x height x
channels, at least the 3 of RGB, and the bytes of a channel) at most :data:`MAX_IMAGE_DECODED`, and a request's
images together at most :data:`MAX_REQUEST_DECODED`. A server decodes them in :data:`IMAGE_WORKERS` image
workers (:class:`ImageWorkers`: processes of their own, :data:`IMAGE_SECONDS` an image, an address-space limit),
apart from the text workers, so that one user's images never stall nor starve the others' requests.
"""
from __future__ import annotations

import base64
import binascii
import io
import os

from .errors import InputError

MAX_IMAGES = 8  # images in one conversation (request)
MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 64 << 20
MAX_IMAGE_DECODED = 160 << 20  # bytes one image decodes to: a 50-megapixel photo in RGB
MAX_REQUEST_DECODED = 384 << 20  # the same, for all of a request's images together
IMAGE_WORKERS = 2  # a server's image workers: the images it decodes at once
IMAGE_SECONDS = 10.0  # an image's decoding (a progressive JPEG's scans), after which its worker is killed
# an image worker's address space past its start: the decoded image, its RGB copy and the resize's rows
IMAGE_MEMORY = 2 * MAX_IMAGE_DECODED + (96 << 20)
FORMATS = ("PNG", "JPEG", "BMP", "GIF")  # what LiteRT-LM's decoder reads too
RESAMPLE = ("bilinear", "bicubic", "lanczos")  # an image processor's resize filter, by Pillow's name


def decoded_size(im) -> int:
    """The bytes an opened (not yet decoded) Pillow image takes once decoded and made RGB."""
    sample = 4 if im.mode in ("I", "F") else 2 if im.mode.startswith("I;16") else 1
    return im.width * im.height * max(3, len(im.getbands())) * sample


def open_image(source, what: str):
    """``source`` (a path, or the bytes of an image file) decoded whole by Pillow: the image, or InputError
    naming ``what`` (the file, or the request's part). Its header is checked first (:func:`open_header`)."""
    if isinstance(source, (str, os.PathLike)):
        from .fileio import read_regular
        source = read_regular(source, f"the image {what}", MAX_IMAGE_BYTES)
    im = open_header(source, what)
    try:
        im.load()
    except Exception as e:  # noqa: BLE001 - whatever Pillow makes of a damaged file
        raise InputError(f"{what} is not an image that can be read ({type(e).__name__}: {str(e)[:200]})") from None
    return im


def open_header(source: bytes, what: str):
    """The image file ``source`` opened (its header read, nothing decoded) and checked: its size, format,
    pixels and decoded size (:func:`decoded_size`) within the bounds; InputError naming ``what`` otherwise."""
    if len(source) > MAX_IMAGE_BYTES:
        raise InputError(f"the image {what} is {len(source):,} bytes, more than {MAX_IMAGE_BYTES:,}")
    try:
        from PIL import Image
    except ImportError as e:
        raise InputError("reading images needs Pillow: pip install pillow") from e
    try:
        im = Image.open(io.BytesIO(source))
    except Exception as e:  # noqa: BLE001 - whatever Pillow makes of a damaged file
        raise InputError(f"{what} is not an image that can be read ({type(e).__name__}: {str(e)[:200]})") from None
    if im.format not in FORMATS:
        raise InputError(f"the image {what} is {im.format}; images are read as {', '.join(FORMATS)}")
    if im.width * im.height > MAX_IMAGE_PIXELS:
        raise InputError(f"the image {what} is {im.width}x{im.height} pixels, more than {MAX_IMAGE_PIXELS:,}")
    if decoded_size(im) > MAX_IMAGE_DECODED:
        raise InputError(f"the image {what} ({im.width}x{im.height}, {im.mode}) decodes to {decoded_size(im):,} "
                         f"bytes, more than {MAX_IMAGE_DECODED:,}")
    return im


def data_url_bytes(url, what: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL (OpenAI's ``image_url`` content part); a remote URL is
    refused: a server fetches nothing a request names."""
    if not isinstance(url, str):
        raise InputError(f"{what}: image_url.url must be a string")
    head, comma, body = url.partition(",")
    if not url.startswith("data:"):
        raise InputError(f"{what}: only data URLs (data:image/png;base64,...) are taken; this server fetches no "
                         "remote images")
    if not comma or not head.endswith(";base64") or not head[5:].startswith("image/"):
        raise InputError(f"{what}: a data URL of an image in base64 is expected (data:image/png;base64,...)")
    if len(body) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InputError(f"{what}: the image is more than {MAX_IMAGE_BYTES:,} bytes")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{what}: the data URL is not valid base64") from None


def read_images(items, vision: dict) -> list:
    """``items`` (``(source, what)`` pairs: a path or file bytes, and what names it in a message), at most
    :data:`MAX_IMAGES`, each as a VLM file's ``vision`` program takes it (:func:`image_pixels` at the size and
    with the filter of its ``llm.vision``), decoded here; InputError naming the first that cannot be read."""
    if len(items) > MAX_IMAGES:
        raise InputError(f"{len(items)} images are more than the {MAX_IMAGES} a request may hold")
    return [image_pixels(source, what, vision["height"], vision["width"], vision["resample"])
            for source, what in items]


def image_pixels(source, what: str, height: int, width: int, resample: str = "bilinear"):
    """``source`` (a path or file bytes) as a vision encoder's input: RGB, resized to ``height`` x ``width``
    with ``resample`` (the image processor's filter), float32 ``[height, width, 3]`` in [0, 1]."""
    import numpy as np
    return np.asarray(_rgb(source, what, height, width, resample), np.float32) / 255.0


def _rgb(source, what: str, height: int, width: int, resample: str):
    from PIL import Image
    im = open_image(source, what).convert("RGB")
    if im.size != (width, height):
        im = im.resize((width, height), getattr(Image.Resampling, resample.upper()))
    return im


def worker_ops(config: dict) -> dict:
    """The image workers' operations (:mod:`torchtpu_export.workers`' role), on base64 file bytes: ``size``
    (the decoded size, from the header) and ``pixels`` (the RGB bytes at the vision program's size)."""
    import numpy as np
    from PIL import Image  # noqa: F401 - imported before the memory limit is set

    def size(data: str, what: str) -> int:
        im = open_header(base64.b64decode(data), what)
        return decoded_size(im)

    def pixels(data: str, what: str, height: int, width: int, resample: str) -> str:
        rgb = np.asarray(_rgb(base64.b64decode(data), what, height, width, resample), np.uint8)
        return base64.b64encode(rgb.tobytes()).decode()
    return {"size": size, "pixels": pixels}


class ImageWorkers:
    """A server's image workers: ``await read(items, vision)`` decodes a request's images (``(file bytes,
    what)`` pairs) as :func:`read_images` does, each in a worker under :data:`IMAGE_SECONDS` and
    :data:`IMAGE_MEMORY`, after their decoded sizes together passed :data:`MAX_REQUEST_DECODED`."""

    def __init__(self, workers: int = IMAGE_WORKERS, time_budget: float = IMAGE_SECONDS):
        from .workers import WorkerError, WorkerPool
        try:
            self._pool = WorkerPool(__name__, {}, what={"size": "reading the image's header",
                                                        "pixels": "decoding the image"},
                                    workers=workers, time_budget=time_budget, memory_budget=IMAGE_MEMORY)
        except WorkerError as e:
            raise InputError(f"the server cannot decode images: {e}") from None

    async def read(self, items, vision: dict) -> list:
        import numpy as np
        if len(items) > MAX_IMAGES:
            raise InputError(f"{len(items)} images are more than the {MAX_IMAGES} a request may hold")
        data = [(base64.b64encode(source).decode(), what) for source, what in items]
        total = 0
        for encoded, what in data:
            total += await self._call("size", what, encoded)
            if total > MAX_REQUEST_DECODED:
                raise InputError(f"the request's images decode to more than {MAX_REQUEST_DECODED:,} bytes together "
                                 f"(at {what})")
        out = []
        h, w = vision["height"], vision["width"]
        for encoded, what in data:
            rgb = base64.b64decode(await self._call("pixels", what, encoded, h, w, vision["resample"]))
            out.append(np.frombuffer(rgb, np.uint8).reshape(h, w, 3).astype(np.float32) / 255.0)
        return out

    async def _call(self, op: str, what: str, encoded: str, *args):
        from .workers import WorkerError
        try:
            return await self._pool.call(op, encoded, what, *args)
        except WorkerError as e:  # the worker's refusals name the image; its time-outs and crashes do not
            raise InputError(str(e) if what in str(e) else f"{what}: {e}") from None

    def close(self) -> None:
        self._pool.close()
