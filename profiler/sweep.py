"""Which batch sizes a profile measures.

GPU time is not linear in the batch size at small sizes (kernels do not fill the GPU yet), and
close to linear above, so a good sweep is dense at small sizes and sparser above. The grammar:

* a comma list of sizes and ranges: ``1-16,32,64,128,256``; ``32-256:32`` is a range with a step;
* ``pow2`` (1, 2, 4, ... up to ``max_batch``) or ``pow2:A-B``;
* ``dense:A-B`` (every size from A to B);
* ``step:S`` (multiples of S up to ``max_batch``) or ``step:S:A-B``;
* ``default`` (:data:`DEFAULT_SWEEP`);
* several of the above joined by ``+``: ``dense:1-16+step:16`` .
"""

from __future__ import annotations

__all__ = ["parse_batch_sizes", "BatchSizeError", "DEFAULT_SWEEP", "MAX_SUPPORTED_BATCH"]

# Dense where timing bends, then roughly geometric: 24 points up to 256.
DEFAULT_SWEEP = "1-16,24,32,48,64,96,128,192,256"
MAX_SUPPORTED_BATCH = 1 << 20

_HELP = (
    "valid forms: '1-16,32,64' (sizes and ranges, 'A-B:STEP' for a stepped range), 'pow2', "
    "'pow2:A-B', 'dense:A-B', 'step:S', 'step:S:A-B', 'default', or several joined by '+' "
    "(e.g. 'dense:1-16+step:16')"
)


class BatchSizeError(ValueError):
    """A batch-size specification that cannot be parsed; the message lists the valid forms."""


def parse_batch_sizes(spec: str, max_batch: int = 256) -> list[int]:
    """Batch sizes named by ``spec``, sorted ascending without duplicates.

    ``max_batch`` bounds the open-ended forms (``pow2``, ``step:S``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise BatchSizeError(f"empty batch-size specification; {_HELP}")
    if max_batch < 1:
        raise BatchSizeError(f"the largest batch size must be at least 1, got {max_batch}")
    sizes: set[int] = set()
    for part in spec.replace(" ", "").split("+"):
        if not part:
            raise BatchSizeError(f"empty part in batch-size specification {spec!r}; {_HELP}")
        sizes.update(_parse_part(part, spec, max_batch))
    if not sizes:
        raise BatchSizeError(f"batch-size specification {spec!r} names no batch size; {_HELP}")
    return sorted(sizes)


def _parse_part(part: str, spec: str, max_batch: int) -> list[int]:
    low = part.lower()
    if low == "default":
        return parse_batch_sizes(DEFAULT_SWEEP, max_batch)
    if low == "pow2" or low.startswith("pow2:"):
        lo, hi = (1, max_batch) if low == "pow2" else _range(low[5:], spec)
        powers, p = [], 1
        while p <= hi:
            if p >= lo:
                powers.append(p)
            p *= 2
        return powers
    if low.startswith("dense:"):
        lo, hi = _range(low[6:], spec)
        return list(range(lo, hi + 1))
    if low.startswith("step:"):
        fields = low[5:].split(":")
        if len(fields) not in (1, 2):
            raise BatchSizeError(f"cannot read {part!r} in {spec!r}; {_HELP}")
        step = _int(fields[0], spec)
        lo, hi = (step, max_batch) if len(fields) == 1 else _range(fields[1], spec)
        first = ((lo + step - 1) // step) * step
        return list(range(first, hi + 1, step))
    out: list[int] = []
    for item in low.split(","):
        if not item:
            raise BatchSizeError(f"empty item in {spec!r}; {_HELP}")
        if "-" in item:
            step = 1
            if ":" in item:
                item, step_text = item.split(":", 1)
                step = _int(step_text, spec)
            lo, hi = _range(item, spec)
            out.extend(range(lo, hi + 1, step))
        else:
            out.append(_int(item, spec))
    return out


def _range(text: str, spec: str) -> tuple[int, int]:
    if text.count("-") != 1:
        raise BatchSizeError(f"cannot read range {text!r} in {spec!r} (expected A-B); {_HELP}")
    a, b = (_int(x, spec) for x in text.split("-"))
    if a > b:
        raise BatchSizeError(f"range {text!r} in {spec!r} runs backwards (start {a} > end {b})")
    return a, b


def _int(text: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise BatchSizeError(f"{text!r} in {spec!r} is not a whole number; {_HELP}") from None
    if not 1 <= value <= MAX_SUPPORTED_BATCH:
        raise BatchSizeError(f"batch sizes and steps must be from 1 to {MAX_SUPPORTED_BATCH}, got {value} in {spec!r}")
    return value
