"""Small synthetic data in the formats third-party scripts read, so they run unmodified with no
download (benchmarks/compat_matrix.py's third-party rows; tests/compat/thirdparty.py says which
row needs what).

    python tests/compat/synthetic.py KIND DEST [--count N]

Each kind writes what the script's own loader looks for, where it looks, so the script finds it
and skips its download: MNIST's raw IDX files, BSDS300's image folders, an ImageFolder tree,
nanoGPT's character text and token files, nanochat's parquet shards, torchtitan's c4_test JSON
lines, and torchvision's VGG-16 checkpoint file (random weights). Values are random: the matrix
checks that scripts run and how they are priced, not what they learn. Run by the interpreter
that runs the scripts (numpy and Pillow; torch and torchvision for ``vgg16``).
"""

from __future__ import annotations

import argparse
import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

SEED = 0


def words(count: int, rng: random.Random) -> list[str]:
    """Pronounceable made-up words (a vocabulary with some repetition, as text has)."""
    syllables = ["ka", "lo", "mi", "re", "tu", "sa", "ne", "vo", "pi", "da", "the", "and", "ing", "er"]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(500)]
    return [rng.choice(vocab) for _ in range(count)]


def text(count: int, rng: random.Random) -> str:
    """Lines of words, capitalised, with punctuation: what a character model's text looks like."""
    out, ws = [], words(count, rng)
    for i in range(0, len(ws), 12):
        out.append(" ".join(ws[i : i + 12]).capitalize() + rng.choice([".", ",", "!", "?", ":"]))
    return "\n".join(out) + "\n"


def char_text(dest: Path, count: int) -> None:
    """nanoGPT's data/shakespeare_char/input.txt (its prepare.py downloads only when it is missing)."""
    path = dest / "data" / "shakespeare_char" / "input.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text(count or 60_000, random.Random(SEED)))


def token_files(dest: Path, count: int) -> None:
    """nanoGPT's data/openwebtext/{train,val}.bin: GPT-2 token ids as uint16 (what its prepare.py writes)."""
    folder = dest / "data" / "openwebtext"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for split, n in (("train", count or 400_000), ("val", (count or 400_000) // 10)):
        rng.integers(0, 50257, size=n, dtype=np.uint16).tofile(folder / f"{split}.bin")


def mnist(dest: Path, count: int) -> None:
    """torchvision's MNIST raw files (IDX) under DEST/MNIST/raw: present, so download=True skips."""
    raw = dest / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for prefix, n in (("train", count or 2048), ("t10k", max(256, (count or 2048) // 4))):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())


def _images(folder: Path, count: int, size: tuple[int, int], rng: np.random.Generator) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:05d}.jpg", quality=90)


def bsds300(dest: Path, count: int) -> None:
    """pytorch/examples super_resolution's DEST/BSDS300/images/{train,test} (present: no download)."""
    rng = np.random.default_rng(SEED)
    _images(dest / "BSDS300" / "images" / "train", count or 32, (320, 320), rng)
    _images(dest / "BSDS300" / "images" / "test", max(4, (count or 32) // 4), (320, 320), rng)


def image_folder(dest: Path, count: int) -> None:
    """An ImageFolder tree, two classes of COUNT images each: DEST/{train,validation}/class_k/ (timm)
    and DEST/train serves a script that takes one folder (fast_neural_style)."""
    rng = np.random.default_rng(SEED)
    for split, n in (("train", count or 64), ("validation", max(8, (count or 64) // 2))):
        for k in range(2):
            _images(dest / split / f"class_{k}", n, (160, 160), rng)


def style_image(dest: Path, count: int) -> None:
    """One style image (fast_neural_style's --style-image) at DEST/style.jpg."""
    _images(dest, 1, (256, 256), np.random.default_rng(SEED))
    (dest / "img_00000.jpg").rename(dest / "style.jpg")


def vgg16(dest: Path, count: int) -> None:
    """torchvision's VGG-16 ImageNet checkpoint file, random weights, in DEST/hub/checkpoints (a
    TORCH_HOME): ``vgg16(weights=IMAGENET1K_V1)`` loads it instead of downloading."""
    import torch
    from torchvision.models import VGG16_Weights, vgg16

    folder = dest / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    torch.save(vgg16().state_dict(), folder / VGG16_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[-1])


def nanochat(dest: Path, count: int) -> None:
    """nanochat's pretraining shards: DEST/base_data_climbmix/shard_0000k.parquet with a ``text``
    column (DEST is NANOCHAT_BASE_DIR; the last shard is its validation split)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = dest / "base_data_climbmix"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    for shard in range(3):
        docs = [text(rng.randint(80, 600), rng) for _ in range(count or 400)]
        pq.write_table(pa.table({"text": docs}), folder / f"shard_{shard:05d}.parquet", row_group_size=100)


def c4_test(dest: Path, count: int) -> None:
    """torchtitan's tests/assets/c4_test/data.json (C4's JSON lines: text, timestamp, url)."""
    path = dest / "tests" / "assets" / "c4_test" / "data.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    with path.open("w") as f:
        for i in range(count or 2000):
            doc = {"text": text(rng.randint(50, 400), rng), "timestamp": "2019-04-25T12:57:54Z", "url": f"doc{i}"}
            f.write(json.dumps(doc) + "\n")


KINDS: dict[str, Callable[[Path, int], None]] = {
    "char-text": char_text,
    "token-files": token_files,
    "mnist": mnist,
    "bsds300": bsds300,
    "image-folder": image_folder,
    "style-image": style_image,
    "vgg16": vgg16,
    "nanochat": nanochat,
    "c4-test": c4_test,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("dest", type=Path)
    p.add_argument("--count", type=int, default=0, help="how many items (documents, images, tokens); 0: its default")
    args = p.parse_args()
    KINDS[args.kind](args.dest, args.count)


if __name__ == "__main__":
    main()
