"""The tests' shortcut to a trainer: build_config's keywords (with this machine's device, world size and
precision rule filled in) turned into the dict AdvancedDeepSpeedTrainer runs. The defaults are the ones the
tests were tuned at (a tiny model, 16 sequences a micro-batch, lr 3e-3 over a 300-step schedule)."""
from helpers.config import build_config
from helpers.runtime import detect, world_size
from helpers.trainer import AdvancedDeepSpeedTrainer

TRAINER_ARGUMENTS = ("model_size", "n_positions", "gradient_checkpointing", "output_dir", "name", "seed",
                     "resume_from", "compile")


def config_for(**options) -> dict:
    """build_config(**options) for this machine: its device, world size and (unless given) precision."""
    rt = detect()
    defaults = dict(micro_batch=16, lr=3e-3, warmup_steps=20, total_steps=300, precision=rt.precision,
                    device=rt.device, world_size=world_size())
    if options.get("precision") == "auto":
        del options["precision"]
    return build_config(**defaults | options)


def make_trainer(data, **options) -> AdvancedDeepSpeedTrainer:
    """AdvancedDeepSpeedTrainer(data, config_for(**config options), **trainer options), split by name."""
    trainer_options = {k: options.pop(k) for k in TRAINER_ARGUMENTS if k in options}
    return AdvancedDeepSpeedTrainer(data, config_for(**options), **{"model_size": "tiny"} | trainer_options)
