"""The data mixture: which source each global sample comes from, and which of that source's samples it is.

Each source s with weight w_s (normalised to sum 1, exact fractions) gets the samples whose "due times" come first:
source s is due at (k + 1/2) / w_s for its k-th sample, and the mixed stream takes the sources' samples in order of
due time (ties to the lower source index). That is stride scheduling (Waldspurger & Weihl): after any g samples,
source s has had w_s g samples to within one, so every optimizer step holds each source's share to within one
sample, with no random drift. It is a pure function of the global sample number: `position(g)` looks only at the
due times around g, so a resumed run, or one of a different process count, draws the same samples.

A single source reduces to k = g, the sample order of runs before mixtures existed.
"""

from __future__ import annotations

import decimal
import math
from fractions import Fraction

from deepseek_zero3.cli import UserError


def normalised(weights: list[Fraction]) -> tuple[Fraction, ...]:
    total = sum(weights)
    return tuple(w / total for w in weights)


def _due_before(w: Fraction, t: Fraction) -> int:
    """How many of a source's samples are due strictly before time t: k with (k + 1/2) / w < t."""
    if w == 0 or t <= 0:
        return 0
    return max(0, math.ceil(w * t - Fraction(1, 2)))


def position(sample: int, weights: tuple[Fraction, ...]) -> tuple[int, int]:
    """(source, k): global sample `sample` is the k-th sample (0-based) of that source."""
    if len(weights) == 1:
        return 0, sample
    # Before time t the number of samples due lies within t +- n/2 (n sources); the sample-th one is due in [lo, hi).
    n = len(weights)
    lo, hi = Fraction(sample) - Fraction(n, 2) - 1, Fraction(sample) + Fraction(n, 2) + 1
    before = [_due_before(w, lo) for w in weights]
    due = sorted(
        ((k + Fraction(1, 2)) / w, s, k)
        for s, w in enumerate(weights)
        if w > 0
        for k in range(before[s], _due_before(w, hi))
    )
    _, s, k = due[sample - sum(before)]
    return s, k


def counts(samples: int, weights: tuple[Fraction, ...]) -> list[int]:
    """How many of the first `samples` global samples each source gave: those due before the last one taken, and at
    its very due time those of sources that come first in a tie."""
    if samples <= 0:
        return [0] * len(weights)
    last, k = position(samples - 1, weights)
    due = (k + Fraction(1, 2)) / weights[last]
    out = []
    for s, w in enumerate(weights):
        at_due = w > 0 and s <= last and (due * w - Fraction(1, 2)).denominator == 1 and due * w >= Fraction(1, 2)
        out.append(_due_before(w, due) + int(at_due))
    return out


def parse_mix(spec: str, names: list[str], windows: list[int]) -> tuple[Fraction, ...]:
    """--data_mix "name=weight,..." as normalised weights in the order of `names`; "" is proportional to each source's
    training windows (the share each has of the data). Sources the spec leaves out get weight 0."""
    if not spec:
        return normalised([Fraction(n) for n in windows])
    given: dict[str, Fraction] = {}
    for item in spec.split(","):
        name, sep, value = (part.strip() for part in item.strip().rpartition("="))
        if not (sep and name):
            raise UserError(f"--data_mix {spec!r}: {item.strip()!r} is not name=weight (e.g. {names[0]}=0.5)")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise UserError(f"--data_mix {spec!r}: the weight of {name}, {value!r}, is not a number of 0 or more")
        if name not in names:
            raise UserError(f"--data_mix {spec!r}: no source is named {name!r}; the sources are {', '.join(names)}")
        if name in given:
            raise UserError(f"--data_mix {spec!r} gives {name} twice; give each source one weight")
        exact = decimal.Decimal(value)  # "0.1" as 1/10, not its float; an exponent past 40 as the float
        given[name] = Fraction(exact) if abs(exact.as_tuple().exponent) <= 40 else Fraction(number)
    weights = [given.get(name, Fraction(0)) for name in names]
    if not any(weights):
        raise UserError(f"--data_mix {spec!r} gives every source weight 0; give at least one a positive weight")
    return normalised(weights)


def renamed(spec: str, names: dict[str, str]) -> str:
    """--data_mix with its source names replaced as `names` says (a checkpoint's names -> today's); the rest as it is,
    for parse_mix to check."""
    if not spec or not names:
        return spec
    items = []
    for item in spec.split(","):
        name, sep, value = item.strip().rpartition("=")
        items.append(f"{names.get(name.strip(), name.strip())}{sep}{value}" if sep else item)
    return ",".join(items)
