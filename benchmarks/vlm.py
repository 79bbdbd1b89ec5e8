"""Vision-language bundles for LiteRT-LM: the size of each section and the image encoder's latency per image.

    python -m benchmarks.vlm [--configs tiny,siglip-b16] [--rounds 5] [-o RESULTS-vlm.md]

For each config, a Gemma 3 VLM (seeded random weights, the local tokenizer, its image processor) is saved as
a Hugging Face folder and exported with ``tte.export_llm(folder, target="litertlm")``; we report the export's
seconds, each section's bytes (as ``inspect`` reads the bundle), and the encoder's and adapter's latency per
image on the LiteRT interpreter (CPU, XNNPACK, a thread per core; the sections read back out of the bundle;
median of ``--rounds`` after one warm-up), then LiteRT-LM's whole reply (engine made once, a conversation per
reply, 8 tokens, median of ``--rounds``) to the prompt with the image and to the prompt alone.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# name -> (image size, vision tower shape, text model shape), all Gemma 3
CONFIGS = {
    "tiny": dict(image_size=32),  # the tests' model
    # SigLIP-B/16's tower at 224 (86M weights, 196 patches pooled to 49 rows) before a 4-layer text model
    "siglip-b16": dict(image_size=224, patch_size=16, vision=dict(hidden_size=768, intermediate_size=3072,
                                                                  num_hidden_layers=12, num_attention_heads=12),
                       tokens=49, text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
}


def _folder(name: str, root: str) -> str:
    import torch

    from examples import hf_vlms
    spec = CONFIGS[name]
    if name == "tiny":
        return hf_vlms.save_folder("gemma3", os.path.join(root, name))
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)
    tok = hf_vlms.gemma3_tokenizer()
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in hf_vlms.GEMMA3_IMAGE_TOKENS.items()}
    text = Gemma3TextConfig(**spec["text"], vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            max_position_embeddings=512, tie_word_embeddings=False)
    vision = SiglipVisionConfig(**spec["vision"], image_size=spec["image_size"], patch_size=spec["patch_size"],
                                vision_use_head=False)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=spec["tokens"], boi_token_index=ids["boi_token"],
                          eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"], tie_word_embeddings=False, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts the projector at zeros: an image would add nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    size = spec["image_size"]
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": size, "width": size}),
                                tokenizer=tok, image_seq_length=spec["tokens"], chat_template=hf_vlms.GEMMA3_TEMPLATE)
    path = os.path.join(root, name)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def measure(name: str, rounds: int, root: str) -> dict:
    import torchtpu_export as tte
    from torchtpu_export.targets.litert.target import EdgeModel
    from torchtpu_export.targets.litertlm.artifact import section_bytes
    from torchtpu_export.targets.litertlm.checks import check

    from examples import hf_vlms
    folder = _folder(name, root)
    size = CONFIGS[name]["image_size"]
    t0 = time.perf_counter()
    bundle = tte.export_llm(folder, target="litertlm", prefill_lengths=(64,), cache_length=256)
    seconds = time.perf_counter() - t0
    path = os.path.join(root, f"{name}.litertlm")
    bundle.save(path)
    checked = check(path)
    sections = {s["model_type"] or s["type"]: s["end"] - s["begin"] for s in checked.sections}
    parts = {s["model_type"]: EdgeModel(section_bytes(path, s)) for s in checked.reads["tflite"]}
    image = hf_vlms.image(1, size)[None].astype(np.float32) / 255
    encoder, adapter = parts["tf_lite_vision_encoder"], parts["tf_lite_vision_adapter"]
    features = encoder.run_flat([image])[0]
    threads = os.cpu_count()
    run_encoder, run_adapter = encoder.runner(num_threads=threads), adapter.runner(num_threads=threads)
    enc_ms = _median_ms(lambda: run_encoder.run([image]), rounds)
    ad_ms = _median_ms(lambda: run_adapter.run([features]), rounds)
    png = hf_vlms.save_image(os.path.join(root, f"{name}.png"), 1, size)
    loaded = tte.load(path)
    reply_ms = _median_ms(lambda: loaded.generate("what is this", 8, images=[png]), rounds)
    text_ms = _median_ms(lambda: loaded.generate("what is this", 8, chat=True), rounds)
    return {"config": name, "image": f"{size}x{size}", "rows": bundle.vision.image_tokens,
            "export_s": seconds, "sections": sections, "encoder_ms": enc_ms, "adapter_ms": ad_ms,
            "reply_ms": reply_ms, "text_ms": text_ms, "check": bundle.llm_check.get("vision")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,siglip-b16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-o", "--output", default=os.path.join(HERE, "RESULTS-vlm.md"))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tte-vlm-bench-") as root:
        for name in args.configs.split(","):
            rows.append(measure(name, args.rounds, root))
            print(rows[-1], flush=True)
    kinds = ["tf_lite_prefill_decode", "tf_lite_vision_encoder", "tf_lite_vision_adapter", "tf_lite_embedder"]
    lines = [f"# VLM bundles (Gemma 3) for LiteRT-LM, {datetime.date.today()}, {platform.machine()} "
             f"{os.cpu_count()} cores", "", "`python -m benchmarks.vlm` (median of "
             f"{args.rounds} after a warm-up; LiteRT interpreter, CPU)", "",
             "| config | image | rows | export s | language model | encoder | adapter | embedder | encoder ms/image "
             "| adapter ms | LiteRT-LM reply, 8 tokens, ms: with the image / text alone | encoder / adapter error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sizes = " | ".join(f"{r['sections'].get(k, 0) / 2**20:.2f} MiB" for k in kinds)
        err = f"{r['check']['encoder_error']:.1e} / {r['check']['adapter_error']:.1e}" if r["check"] else "-"
        lines.append(f"| {r['config']} | {r['image']} | {r['rows']} | {r['export_s']:.1f} | {sizes} | "
                     f"{r['encoder_ms']:.2f} | {r['adapter_ms']:.2f} | {r['reply_ms']:.0f} / {r['text_ms']:.0f} | "
                     f"{err} |")
    with open(args.output, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
