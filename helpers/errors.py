"""The errors a reader's input can cause, found before anything expensive starts. Every entry point (the
script, the trainer, run_program) shows an InputError as one line naming the key and the fix."""
import argparse
import math


class InputError(ValueError):
    """A mistake in what the reader gave (a config, data, a checkpoint, an option): the message names it."""


class ConfigError(InputError):
    """A DeepSpeed config problem found before any engine is built. The message names the field."""


class DataError(InputError):
    """Text or a dataset that cannot be trained on as given (missing, empty, too short). The message says why."""


class CostWarning(UserWarning):
    """A run that will start but may run out of memory or take minutes to set up. A UserWarning, which Python
    shows by default: a ResourceWarning is hidden unless asked for (-W default)."""


def require_positive_int(name: str, value) -> None:
    """Raise ConfigError (a ValueError) naming `name` unless `value` is an int >= 1 (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


# argparse types for the scripts' numeric flags: argparse prints "argument --lr: ..." and exits 2, one line
# naming the flag, before any rank or model starts. float() alone accepts 'nan' and 'inf'.

def integer(minimum: int, why: str = ""):
    """An argparse type: an int >= minimum; `why` says what the bound is for."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}" + (f" ({why})" if why else ""))
        return value
    return parse


def number(minimum: float = 0.0, *, strict: bool = True):
    """An argparse type: a finite float > minimum (>= minimum when not `strict`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {'>' if strict else '>='} {minimum:g}")
        return value
    return parse
