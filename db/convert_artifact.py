"""Dev-time converter: GPEmu artifact data -> the compact files shipped in db/data/.

Run once by a developer (the project never reads /work/shared at run time):

    python -m gpemu.db.convert_artifact /work/shared/data db/data

What it writes (all committed, ~2 MB together):
- ``measurements.csv.gz``: ``gpu,model,kind,batch_size,value`` for forward, backward,
  h2d_transfer (seconds per batch), model_transfer (seconds, batch_size 0), peak_memory and
  persistent_memory (bytes; the artifact gives MiB). Times keep 6 significant digits (far finer
  than the run-to-run spread of the measurements).
- ``models.csv``: the 36 torchvision architectures' structure and FLOPs.
- ``distributions.json.gz``: sampled distributions (GPU preprocessing time per batch,
  per-iteration time series of real training runs, DALI preprocessing memory growth).

Memory rows whose batch size is not a whole number (the authors' regression fill-ins) are
dropped and counted (the artifact has none today); memory values below zero (regression
fill-ins: K80 resnet152 persistent memory at batch 234..256, 23 rows) and persistent memory
below the model's parameter bytes (impossible: the parameters stay on the GPU; K80 resnet152 at
batch 201..233, 33 rows) are dropped and counted.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
import sys
from pathlib import Path

_MiB = 1 << 20


def _fmt(x: float) -> str:
    return f"{x:.6g}"


@functools.cache
def _short_name(gpu_folder: str) -> str:
    """The short name (e.g. ``V100``) of a GPU folder of the artifact: its name is one of the
    measured GPU's aliases in the table of GPU facts (``Tesla_V100-PCIE-32GB``)."""
    from gpemu.costmodel.gpus import find_gpu

    sheet = find_gpu(gpu_folder)
    if sheet is None or not sheet.measured:
        raise ValueError(f"{gpu_folder!r} is not the folder of a measured GPU of gpemu.costmodel.gpus.GPUS")
    return sheet.short_name


def _batch(text: str) -> int | None:
    """Whole-number batch size, or None for a fractional one (a regression fill-in)."""
    b = float(text)
    return int(b) if b == int(b) else None


def _timed_batch(text: str) -> int:
    """The batch size of a measured time: always a whole number (fill-ins are memory rows only)."""
    b = _batch(text)
    if b is None:
        raise ValueError(f"a time row has the fractional batch size {text!r}")
    return b


def convert(shared_data: Path, out_dir: Path) -> dict[str, int]:
    prof = shared_data / "gpemu-artifact" / "profiled_data"
    out_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {
        "dropped_fractional_memory_rows": 0,
        "dropped_negative_memory_rows": 0,
        "dropped_persistent_below_params_rows": 0,
    }
    param_bytes = {
        r["model"]: int(r["param_bytes"]) for r in csv.DictReader((shared_data / "torchvision_models.csv").open())
    }
    rows: list[tuple[str, str, str, int, str]] = []

    def add(gpu_folder: str, model: str, kind: str, bs: int, value: str) -> None:
        rows.append((_short_name(gpu_folder), model, kind, bs, value))
        counts[kind] = counts.get(kind, 0) + 1

    for kind in ("forward", "backward"):
        for f in sorted((prof / "time" / "compute" / kind).glob("*/*/time_by_batch_size.csv")):
            gpu, model = f.parent.parent.name, f.parent.name
            for r in list(csv.reader(f.open()))[1:]:
                add(gpu, model, kind, _timed_batch(r[0]), _fmt(float(r[1])))
    for f in sorted((prof / "time" / "transfer").glob("*/*/data_transfer_time_by_batch_size.csv")):
        gpu, model = f.parent.parent.name, f.parent.name
        for r in list(csv.reader(f.open()))[1:]:
            add(gpu, model, "h2d_transfer", _timed_batch(r[0]), _fmt(float(r[1])))
    for f in sorted((prof / "time" / "transfer").glob("*/*/model_transfer_time.txt")):
        add(f.parent.parent.name, f.parent.name, "model_transfer", 0, _fmt(float(f.read_text().strip())))
    for f in sorted((prof / "memory").glob("*/*/memory.csv")):
        gpu, model = f.parent.parent.name, f.parent.name
        for cells in csv.DictReader(f.open()):
            bs = _batch(cells["batch_size"])
            if bs is None:
                counts["dropped_fractional_memory_rows"] += 1
                continue
            for kind, col in (("peak_memory", "peak"), ("persistent_memory", "persistent")):
                value = float(cells[col])
                if value < 0:  # a regression fill-in gone below zero: not a measurement
                    counts["dropped_negative_memory_rows"] += 1
                    continue
                if kind == "persistent_memory" and value * _MiB < param_bytes[model]:
                    # The parameters alone stay on the GPU between batches: less is impossible.
                    counts["dropped_persistent_below_params_rows"] += 1
                    continue
                add(gpu, model, kind, bs, str(round(value * _MiB)))

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["gpu", "model", "kind", "batch_size", "value"])
    w.writerows(rows)
    # mtime=0: the same input gives byte-identical output (stable data version hash).
    with gzip.GzipFile(out_dir / "measurements.csv.gz", "wb", mtime=0, compresslevel=9) as gz:
        gz.write(buf.getvalue().encode())

    (out_dir / "models.csv").write_text((shared_data / "torchvision_models.csv").read_text())

    dists = _distributions(shared_data / "gpemu-artifact" / "measurements")
    counts["distributions"] = len(dists)
    with gzip.GzipFile(out_dir / "distributions.json.gz", "wb", mtime=0, compresslevel=9) as gz:
        gz.write(json.dumps(dists, separators=(",", ":")).encode())
    return counts


def _column_floats(path: Path) -> tuple[list[str] | None, list[list[float]]]:
    """Tab-separated columns of floats, with the header row when there is one."""
    lines = [ln.split() for ln in path.read_text().splitlines() if ln.strip()]
    header = None
    try:
        float(lines[0][0])
    except ValueError:
        header, lines = lines[0], lines[1:]
    cols = [[float(row[i]) for row in lines] for i in range(len(lines[0]))]
    return header, cols


def _distributions(meas: Path) -> list[dict]:
    src = "GPEmu artifact (Wang et al., PVLDB 18(6), 2025)"
    out: list[dict] = []
    for name, fname, desc in (
        ("decode-dali", "time_prep_decode-dali.csv", "seconds per batch of DALI GPU JPEG decoding (Fig. 2b)"),
        ("norm-ffcv", "time_prep_norm-ffcv.csv", "seconds per batch of FFCV GPU normalization (Fig. 2b)"),
    ):
        _, cols = _column_floats(meas / fname)
        out.append({"name": name, "unit": "seconds", "samples": cols[0], "source": src, "description": desc})
    # Per-iteration series of real training runs; the slow first iterations are kept on purpose.
    names3 = ("transfer", "forward", "backward")
    for f in sorted(meas.glob("time_comp_cdf_*.csv")):
        stem = f.stem.removeprefix("time_comp_cdf_")  # e.g. resnet50-batch128-v100
        header, cols = _column_floats(f)
        if header is not None:
            labels = [h.replace("cpu2gpu_time", "transfer").replace("gpu_time", "gpu") for h in header]
        else:
            labels = list(names3[: len(cols)]) if len(cols) == 3 else [f"col{i}" for i in range(len(cols))]
        for label, col in zip(labels, cols, strict=False):
            out.append(
                {
                    "name": f"iter-{stem}-{label}",
                    "unit": "seconds",
                    "samples": col,
                    "source": src,
                    "description": f"{label} seconds of each of {len(col)} real training iterations ({stem})",
                }
            )
    prep_mem = meas / "mem_consump_prep_mem-b64-t4.txt"
    if prep_mem.exists():
        _, cols = _column_floats(prep_mem)
        out.append(
            {
                "name": "prep-mem-dali-b64-t4",
                "unit": "bytes",
                "samples": cols[1],
                "source": src,
                "description": "GPU memory of DALI preprocessing sampled over time, batch 64, T4 (Fig. 3b)",
            }
        )
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m gpemu.db.convert_artifact SHARED_DATA_DIR OUT_DIR")
    print(convert(Path(sys.argv[1]), Path(sys.argv[2])))
