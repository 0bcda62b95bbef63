"""TTFT of a request with one image against the same prompt without it and a text prompt of the same length.

    python bench/vision_ttft.py [--side 448 --repeats 5] [--out result.json]      # k3-tiny, CPU
    python bench/vision_ttft.py --platform nvidia --dtype bfloat16       # on a GPU
    python bench/vision_ttft.py --preset k3-slice --platform nvidia --dtype bfloat16   # K3 width, K3 tower
    python bench/vision_ttft.py --smoke --out /tmp/v.json    # CI smoke (112 px, no chat turn, 1 repeat)

k3-tiny carries the tiny MoonViT tower; k3-slice (12 layers of K3's width) carries the published
K3 tower (27 layers, width 1024; k3.presets.K3_VISION_CONFIG), its weights drawn at random on
the device (`load_format="dummy"`). Three prompts:

- image: one random --side x --side image (navit resize, patchify, the tower and the projector
  run inside the request; placeholders expanded);
- text: the same prompt without the image (the peer a user sees: what the image costs);
- same_length: the image prompt's expanded ids with the placeholders replaced by text tokens
  (the same prefill length without the encoder: what the encoder costs).

With a tokenizer (the tiny presets) the prompt is a K3 chat turn rendered by
`k3.chat.template.chat_prompt_ids` ("Describe this picture." and the image part); without one
(k3-slice has the full vocabulary, whose tokenizer is not bundled) it is
--text-tokens fixed ordinary token ids with the image placeholder in the middle (--dummy runs
that path on any preset: `--preset k3-tiny --dummy --smoke` tries k3-slice's on the CPU).

TTFT = time from add_request (which preprocesses the image) to the request's first token (wall,
and the process's CPU time, the steadier figure on a shared machine), one request at a time; one warm-up of each prompt, then --repeats rounds in turn; p50 of each.
Prefix caching is off so every repeat prefills (and encodes) in full; the encoder-run counter
checks that. Printed (and written to --out) as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from k3.chat.template import chat_prompt_ids
from k3.checkpoint.writer import write_config
from k3.cli.checkpoint import init_checkpoint
from k3.config import K3Config
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def ttft(engine: LLMEngine, prompt: list[int], image: torch.Tensor | None) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) from add_request to the first token of one request
    alone. The CPU time is the steadier figure on a shared machine."""
    start, cpu = time.perf_counter(), time.process_time()
    engine.add_request(f"m{time.monotonic_ns()}", prompt, FIRST_TOKEN,
                       {"image": [image]} if image is not None else None)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start, time.process_time() - cpu


def synthetic_ids(n: int, vocab_size: int) -> list[int]:
    """n fixed ordinary token ids (a prompt for a model without its tokenizer): drawn from the
    first half of the vocabulary (past its first sixteenth), where the special tokens are not."""
    return torch.randint(vocab_size // 16, vocab_size // 2, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def prompts(engine: LLMEngine, image: torch.Tensor, *, chat: bool = True,
            text_tokens: int | None = None) -> dict[str, tuple[list[int], torch.Tensor | None]]:
    """The three cases (ids, image or None). chat=False (the smoke) leaves out the chat turn's
    markers and system message: the question's ids, then one placeholder; text_tokens: a
    synthetic prompt of that many ids with the placeholder in the middle (no tokenizer)."""
    tok, ph = engine.tokenizer, engine.model_config.media_placeholder_token_id
    question = "Describe this picture."
    if text_tokens is not None:
        without = synthetic_ids(text_tokens, engine.model_config.vocab_size)
        with_image = without[: text_tokens // 2] + [ph] + without[text_tokens // 2:]
        filler = without
    elif chat:
        text = {"type": "text", "text": question}
        image_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}   # rendered, not loaded
        with_image = chat_prompt_ids(tok, [{"role": "user", "content": [text, image_part]}])
        without = chat_prompt_ids(tok, [{"role": "user", "content": [text]}])
    else:
        without = tok.encode(question, allow_special=False)
        with_image = without + [ph]
    expanded, _ = engine.media.prepare(with_image, [image])
    if text_tokens is None:
        filler = tok.encode(question + " ", allow_special=False)       # text tokens in the image's place
    same_length, k = [], 0
    for t in expanded:
        same_length.append(filler[k % len(filler)] if t == ph else t)
        k += t == ph
    return {"image": (with_image, image), "text": (without, None), "same_length": (same_length, None)}


def engine_config(preset: str, platform: str, dtype: str, *, dummy: bool) -> EngineConfig:
    """A random checkpoint of the preset with its tokenizer, or (dummy) the preset's config alone
    and random weights drawn on the device (no tokenizer)."""
    common = dict(platform=platform, dtype=dtype, load_progress=False, max_model_len=4096,
                  max_num_batched_tokens=4096, enable_prefix_caching=False)
    if not dummy:
        ckpt = init_checkpoint(preset, tempfile.mkdtemp(prefix="k3-bench-vision-"), progress=False)
        return EngineConfig(model=str(ckpt), kv_cache_memory_gib=0.05, **common)
    model_dir = Path(tempfile.mkdtemp(prefix="k3-bench-vision-"))
    write_config(model_dir, K3Config.preset(preset))
    # eager: the first token comes from the prefill forward, which no decode graph replays, so
    # capturing graphs would only lengthen the start-up
    return EngineConfig(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, max_num_seqs=4,
                        enforce_eager=True, **common)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=448, help="image side in pixels (default 448: 256 image tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--preset", default="k3-tiny", help="k3-tiny (tiny tower, chat turn) or k3-slice (K3 width and "
                    "tower, random weights drawn on the device, synthetic prompt)")
    ap.add_argument("--dummy", action="store_true", help="the preset's config alone, random weights drawn on the "
                    "device and a synthetic prompt of --text-tokens ids (the default for presets other than "
                    "k3-tiny: how k3-slice runs, tried at tiny size)")
    ap.add_argument("--text-tokens", type=int, default=290, help="synthetic prompt length without the image "
                    "(default 290: k3-tiny's chat turn)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--platform", default="reference", help="k3 platform to run on (default: the CPU reference)")
    ap.add_argument("--smoke", action="store_true", help="a 112 px image after the bare question, 1 repeat")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    side, repeats = (112, 1) if args.smoke else (args.side, args.repeats)
    tiny = args.preset.startswith("k3-tiny")
    synthetic = args.dummy or not tiny
    engine = LLMEngine(engine_config(args.preset, args.platform, args.dtype, dummy=synthetic))
    if engine.media is None:
        raise SystemExit(f"{args.preset} has no vision tower in this build")
    image = torch.rand(3, side, side, generator=torch.Generator().manual_seed(0))
    cases = prompts(engine, image, chat=not args.smoke, text_tokens=args.text_tokens if synthetic else None)
    for ids, img in cases.values() if not args.smoke else ():          # warm-up
        ttft(engine, ids, img)
    runs_before = engine.media.stats["mm_encoder_runs_total"]
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (ids, img) in cases.items():
            wall, used = ttft(engine, ids, img)
            times[name].append(wall)
            cpu[name].append(used)
    encoder_runs = engine.media.stats["mm_encoder_runs_total"] - runs_before
    assert encoder_runs == repeats, f"the encoder ran {encoder_runs} times for {repeats} image requests"
    p50 = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    cpu50 = {name: statistics.median(t) * 1e3 for name, t in cpu.items()}
    image_tokens = engine.media.num_tokens(image)
    result = {
        "model": f"{args.preset} with its {'tiny' if tiny else 'K3'} vision tower ({args.dtype}, random weights, "
                 f"{engine.platform.name} platform, {engine.device})",
        "tower": {k: getattr(engine.media.tower.cfg, k) for k in ("num_layers", "hidden_size", "num_heads",
                                                                   "qkv_hidden_size", "intermediate_size")},
        "prompt": "synthetic ids" if synthetic else ("question + placeholder" if args.smoke else "K3 chat turn"),
        "image_side_px": side, "image_tokens": image_tokens,
        "prompt_tokens": {"image": len(cases["same_length"][0]), "text": len(cases["text"][0]),
                          "same_length": len(cases["same_length"][0])},
        "ttft_p50_ms": {name: round(v, 2) for name, v in p50.items()},
        "image_over_text": round(p50["image"] / p50["text"], 2),
        "image_over_same_length": round(p50["image"] / p50["same_length"], 2),
        "cpu_ms_p50": {name: round(v, 2) for name, v in cpu50.items()},
        "cpu_image_over_text": round(cpu50["image"] / cpu50["text"], 2),
        "cpu_image_over_same_length": round(cpu50["image"] / cpu50["same_length"], 2),
        "ttft_ms_all": {name: [round(x * 1e3, 2) for x in t] for name, t in times.items()},
        "repeats": repeats, "encoder_runs": encoder_runs, "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
