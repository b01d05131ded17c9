"""The errors a reader's input can cause, found before anything expensive starts. Every entry point (the
script, the trainer, run_program) shows an InputError as one line naming the key and the fix."""


class InputError(ValueError):
    """A mistake in what the reader gave (a config, data, a checkpoint, an option): the message names it."""


class ConfigError(InputError):
    """A DeepSpeed config problem found before any engine is built. The message names the field."""


class DataError(InputError):
    """Text or a dataset that cannot be trained on as given (missing, empty, too short). The message says why."""


def require_positive_int(name: str, value) -> None:
    """Raise ConfigError (a ValueError) naming `name` unless `value` is an int >= 1 (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
