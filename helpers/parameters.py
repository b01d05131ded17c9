"""A notebook's parameters cell, checked in one call right after it, before anything starts: a value the notebook
cannot run is refused with one line that names the parameter and what to use, the same error in every notebook.

    check_parameters(globals(), SEED=integer(0), LR=number(1e-3, 1e-2), PRECISION=choice("auto", "fp32", "bf16"))

Each rule also knows the values at its edges (accepted) and just past them (refused): tests/test_parameters.py
tries them on every notebook's own call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import InputError


@dataclass(frozen=True)
class Rule:
    accepts: Callable[[object], bool]
    use: str                 # what to use instead, as the error says it
    edges: tuple = ()        # values the rule accepts at its edges
    outside: tuple = ()      # values just past them, which it refuses


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int, high: int | None = None, *, step: int = 1, why: str = "") -> Rule:
    """An int from low to high (no upper bound when None), a multiple of `step` when step > 1."""
    # `high` may be another parameter (SUCCESSORS=integer(1, N_WORDS)): not an int when that one is bad, and then
    # that one, checked first, is refused before this rule is asked.
    top = (high,) if _is_int(high) else ()

    def accepts(v):
        return _is_int(v) and v >= low and (high is None or v <= high) and v % step == 0
    what = "an even integer" if step == 2 else f"a multiple of {step}" if step > 1 else "an integer"
    span = f" from {low} to {high}" if high is not None else f" >= {low}"
    return Rule(accepts, what + span + (f" ({why})" if why else ""), edges=(low, *top),
                outside=(low - step, *(t + step for t in top), *((low + 1,) if step > 1 else ()), float(low), True))


def number(low: float, high: float) -> Rule:
    """A finite int or float from low to high."""
    def accepts(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high
    return Rule(accepts, f"a number from {low:g} to {high:g}", edges=(low, high),
                outside=(low / 2 if low > 0 else low - 1, high * 2 if high > 0 else high + 1, float("nan"), str(low)))


def choice(*values) -> Rule:
    """One of `values`."""
    return Rule(lambda v: any(v == x and type(v) is type(x) for x in values),
                ("one of " if len(values) > 1 else "") + ", ".join(map(repr, values)), edges=values,
                outside=("none of these",))


def either(*rules: Rule) -> Rule:
    """What any of `rules` accepts."""
    return Rule(lambda v: any(r.accepts(v) for r in rules), " or ".join(r.use for r in rules),
                edges=tuple(e for r in rules for e in r.edges),
                outside=tuple(o for r in rules for o in r.outside if not any(q.accepts(o) for q in rules)))


def increasing(rule: Rule) -> Rule:
    """A tuple of one or more values, each accepted by `rule`, in increasing order without repeats."""
    def accepts(v):
        return (isinstance(v, tuple) and len(v) >= 1 and all(rule.accepts(x) for x in v)
                and list(v) == sorted(set(v)))
    first = rule.edges[0]
    return Rule(accepts, f"a tuple of increasing values, each {rule.use}", edges=(tuple(rule.edges),),
                outside=((), (first, first), list(rule.edges), *((x,) for x in rule.outside[:1])))


def check_parameters(values: dict, **rules: Rule) -> None:
    """Refuse the first of `rules`' parameters (looked up in `values`, a notebook's globals()) whose value its rule
    does not accept: InputError("NAME=value: use ..."), one line. Nothing else happens here."""
    for name, rule in rules.items():
        if not rule.accepts(values[name]):
            raise InputError(f"{name}={values[name]!r}: use {rule.use}")
