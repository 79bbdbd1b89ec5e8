"""Images a user gives a vision-language model (a file for LiteRT-LM, a data URL in an OpenAI request), read
whole by Pillow within size bounds before anything else sees them: a damaged or oversized image is one
message (InputError), never a decoder's crash or a gigabyte allocation. No torch here."""
from __future__ import annotations

import base64
import binascii
import io
import os

from .errors import InputError

MAX_IMAGES = 8  # images in one conversation (request)
MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 64 << 20
FORMATS = ("PNG", "JPEG", "BMP", "GIF")  # what LiteRT-LM's decoder reads too
RESAMPLE = ("bilinear", "bicubic", "lanczos")  # an image processor's resize filter, by Pillow's name


def open_image(source, what: str):
    """``source`` (a path, or the bytes of an image file) decoded whole by Pillow: the image, or InputError
    naming ``what`` (the file, or the request's part)."""
    if isinstance(source, (str, os.PathLike)):
        try:
            size = os.path.getsize(source)
        except OSError as e:
            raise InputError(f"cannot read the image {what}: {e.strerror}") from None
    else:
        size = len(source)
        source = io.BytesIO(source)
    if size > MAX_IMAGE_BYTES:
        raise InputError(f"the image {what} is {size:,} bytes, more than {MAX_IMAGE_BYTES:,}")
    try:
        from PIL import Image
    except ImportError as e:
        raise InputError("reading images needs Pillow: pip install pillow") from e
    try:
        im = Image.open(source)
        if im.format not in FORMATS:
            raise InputError(f"the image {what} is {im.format}; images are read as {', '.join(FORMATS)}")
        if im.width * im.height > MAX_IMAGE_PIXELS:
            raise InputError(f"the image {what} is {im.width}x{im.height} pixels, more than {MAX_IMAGE_PIXELS:,}")
        im.load()
        return im
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever Pillow makes of a damaged file
        raise InputError(f"{what} is not an image that can be read ({type(e).__name__}: {str(e)[:200]})") from None


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
    with the filter of its ``llm.vision``); InputError naming the first that cannot be read."""
    if len(items) > MAX_IMAGES:
        raise InputError(f"{len(items)} images are more than the {MAX_IMAGES} a request may hold")
    return [image_pixels(source, what, vision["height"], vision["width"], vision["resample"])
            for source, what in items]


def image_pixels(source, what: str, height: int, width: int, resample: str = "bilinear"):
    """``source`` (a path or file bytes) as a vision encoder's input: RGB, resized to ``height`` x ``width``
    with ``resample`` (the image processor's filter), float32 ``[height, width, 3]`` in [0, 1]."""
    import numpy as np
    from PIL import Image
    im = open_image(source, what).convert("RGB")
    if im.size != (width, height):
        im = im.resize((width, height), getattr(Image.Resampling, resample.upper()))
    return np.asarray(im, np.float32) / 255.0
