"""Hand-built image files for the hostile-input tests."""
import io

import numpy as np


def _scans_jpeg(size: int, repeats: int) -> bytes:
    """A progressive JPEG whose smallest scan is repeated: a small file that decodes for seconds (each scan
    walks every block of the image), as a red team's 917 KB file of 26,000 scans did for a minute."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size), 128, np.uint8)).save(buf, "JPEG", progressive=True, quality=50)
    data, i, segments = buf.getvalue(), 2, []
    while data[i + 1] != 0xD9:
        j = i + 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if data[i + 1] == 0xDA:  # a scan: its entropy-coded data runs to the next marker
            while True:
                j = data.index(b"\xff", j)
                if data[j + 1] == 0 or 0xD0 <= data[j + 1] <= 0xD7:
                    j += 2
                    continue
                break
        segments.append(data[i:j])
        i = j
    small = min((s for s in segments if s[1] == 0xDA), key=len)
    return b"\xff\xd8" + b"".join(segments) + small * repeats + b"\xff\xd9"
