"""Cheaper communication (notebook 06): gradients averaged across ranks in fp32, bf16 or fp16.

DeepSpeed's `communication_data_type` casts each gradient bucket to that type just before the
all-reduce / reduce-scatter and back afterwards, so bf16 or fp16 halves the gradient bytes on the
wire while the model, its gradients and the optimizer stay in the training precision. In 0.19 every
ZeRO stage honours it: stage 0 in `engine.allreduce_bucket` (engine.py:3795), stages 1-2 in
`allreduce_bucket` / `average_tensor` (zero/stage_1_and_2.py:2359), stage 3 in `__avg_scatter_grads`
(zero/stage3.py:1913). It is a gradient setting only: ZeRO's parameter all-gathers stay in the
parameters' own dtype, and the gradient-norm all-reduce stays in fp32 (fp64 at stage 3). Left unset,
it defaults to the training precision (engine.py:1719), so we train in fp32 to see all three.

    torchrun --nproc_per_node 2 -m helpers.programs.comm_dtype --out runs/comm --dtypes fp32 bf16

One run per communication dtype, same model, data and seed; or `--zeropp weights gradients hpz` for
one ZeRO++ trial (see `zeropp_trial`). helpers.comms turns the results into a table.
"""
import argparse
import traceback

from helpers import comms
from helpers.config import build_config
from helpers.errors import ConfigError
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import save_config, write_result
from helpers.memory.measured import measurement_zero_extra
from helpers.model import MODEL_SIZES, gpt2_param_count
from helpers.precision import PRECISIONS, add_precision_flag
from helpers.runtime import detect, rank_process, resolve_precision, world_size
from helpers.trainer import AdvancedDeepSpeedTrainer

COMM_DTYPES = tuple(PRECISIONS)
# Collectives that sum gradients across ranks. All-gathers and broadcasts move parameters and
# bookkeeping (ZeRO-3 checks its parameter order with int64 broadcasts), never gradients.
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter")
# A reduction this small holds a single number: the global gradient norm, summed in fp32 (stages 0-2)
# or fp64 (stage 3) whatever communication_data_type says. Gradient buckets are far larger.
SCALAR_BYTES = 8
ZEROPP_FEATURES = ("weights", "gradients", "hpz")   # quantized weights (qwZ), quantized gradients (qgZ), hpZ


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--dtypes", nargs="+", choices=COMM_DTYPES, default=["fp32", "bf16"],
                   help="communication_data_type values, run one after another")
    p.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (all of 0-3 honour the setting)")
    add_precision_flag(p, default="fp32", help="training precision; fp32 so the dtypes differ")
    p.add_argument("--steps", type=integer(1), default=24)
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--seq-len", type=integer(2), default=64)
    p.add_argument("--micro-batch", type=integer(1), default=4)
    p.add_argument("--grad-accum", type=integer(1), default=1)
    p.add_argument("--lr", type=number(), default=3e-3)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--zeropp", nargs="*", choices=ZEROPP_FEATURES, default=None,
                   help="instead: one ZeRO++ trial at stage 3 with these features")
    p.add_argument("--hpz", type=integer(1), default=1, help="zero_hpz_partition_size for the 'hpz' feature")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    if a.steps < 3:
        raise SystemExit(f"--steps={a.steps}: need at least 3 (a warm-up, a logged and a timed step)")
    data = SyntheticTextDataset("markov", n_samples=1024, seq_len=a.seq_len, seed=a.seed)
    n_layer, n_embd, _ = MODEL_SIZES[a.model_size]
    n_params = gpt2_param_count(data.vocab_size, a.seq_len, n_layer, n_embd)
    with rank_process():   # quiet logs, the launcher's group (the trainer keeps it); at the end a barrier and its end
        if a.zeropp is not None:
            write_result(a.out, zeropp_trial(a, data, n_params))
        else:
            write_result(a.out, {"runs": [run_dtype(a, d, data, n_params) for d in a.dtypes]})


def gradient_collectives(logged: dict) -> dict:
    """The part of `comms.logged()` output that carries gradients: reductions of more than one number."""
    return {op: {size: count for size, count in sizes.items() if int(size) > SCALAR_BYTES}
            for op, sizes in logged.items() if op in REDUCTIONS}


def run_config(a, stage: int, n_params: int, zero_extra: dict | None = None, extra: dict | None = None) -> dict:
    """The DeepSpeed config every run of this experiment shares (batch, schedule, small ZeRO buckets), plus
    what one run changes: `zero_extra` in the zero_optimization block, `extra` at the top level."""
    rt = detect()
    return build_config(zero_stage=stage, precision=resolve_precision(a.precision, rt), micro_batch=a.micro_batch,
                        grad_accum=a.grad_accum, lr=a.lr, warmup_steps=2, total_steps=a.steps + 1, device=rt.device,
                        world_size=world_size(), zero_extra=measurement_zero_extra(n_params) | (zero_extra or {}),
                        extra={"comms_logger": comms.LOGGER_BLOCK, **(extra or {})})


def log_one_step(trainer) -> dict:
    """Train one step; return what DeepSpeed's comms logger (the config's block) recorded: {op: {msg bytes: count}}."""
    from deepspeed.comm import comms_logger
    comms_logger.reset_data()
    trainer.train(1, progress=False)
    return comms.logged()


def run_dtype(a, dtype: str, data, n_params: int) -> dict:
    """Train with gradients communicated in `dtype`; return bytes sent per step, losses and step times."""
    config = run_config(a, a.stage, n_params, extra={"communication_data_type": dtype})
    save_config(a.out, dtype, config)
    trainer = AdvancedDeepSpeedTrainer(data, config, model_size=a.model_size, seed=a.seed, output_dir=f"{a.out}/{dtype}")
    trainer.train(1, progress=False)     # warm-up: buffers allocated, optimizer state created
    logged = log_one_step(trainer)
    timed = trainer.train(a.steps - 2, progress=False)
    world = trainer.engine.world_size
    result = {
        "dtype": dtype, "stage": a.stage, "world_size": world, "n_params": n_params,
        "precision": trainer.precision, "device": str(trainer.engine.device),
        # what the engine actually uses: proves the config key reached DeepSpeed
        "engine_comm_dtype": str(trainer.engine.communication_data_type).replace("torch.", ""),
        "comm_logged": logged, "comm_sent_bytes": comms.sent_bytes(logged, world),
        "gradient_logged": gradient_collectives(logged),
        "gradient_sent_bytes": sum(comms.sent_bytes(gradient_collectives(logged), world).values()),
        "losses": [m["loss"] for m in trainer.history], "step_s": [m["step_s"] for m in timed]}
    trainer.engine.destroy()   # release hooks and buffers before the next engine
    return result


# ---- ZeRO++: quantized weights (qwZ), hierarchical partitioning (hpZ), quantized gradients (qgZ) ----


def zeropp_block(features=ZEROPP_FEATURES, hpz_partition_size: int = 1) -> dict:
    """The zero_optimization keys that switch on the chosen ZeRO++ features."""
    unknown = set(features) - set(ZEROPP_FEATURES)
    if unknown:
        raise ValueError(f"unknown ZeRO++ features {sorted(unknown)}: choose from {ZEROPP_FEATURES}")
    return {"zero_quantized_weights": "weights" in features,
            "zero_quantized_gradients": "gradients" in features,
            "zero_hpz_partition_size": hpz_partition_size if "hpz" in features else 1}


def zeropp_trial(a, data, n_params: int) -> dict:
    """One rank's ZeRO++ trial: build the engine, train a few steps, report where (if anywhere) it failed.

    On a CPU helpers.config refuses ZeRO++ before DeepSpeed sees it (a ConfigError result). Why: what
    DeepSpeed 0.19.8 itself did on a CPU with that check switched off (measured once here, gloo, 1 NUMA
    node, so DeepSpeed counts every CPU rank as a node of its own):
    - zero_quantized_weights fails inside deepspeed.initialize, on any number of ranks: zero.Init builds a
      CUDAQuantizer (zero/partition_parameters.py:1154), whose QuantizerBuilder().load() is the CPU
      accelerator's NotImplementedBuilder: "ValueError: This op had not been implemented on CPU backend."
      (ops/op_builder/cpu/no_impl.py:21).
    - zero_quantized_gradients initializes, then fails in the first backward with the same ValueError,
      from all_to_all_quant_reduce (runtime/comm/coalesced_collectives.py:34) - but only with more than
      one "node": __avg_scatter_grads (zero/stage3.py:1928) takes the quantized path only when
      world_size // accelerator.device_count() > 1 and otherwise falls back, silently, to a plain
      reduce_scatter. So on 1 rank it "runs" without quantizing anything; on one GPU node too.
    - zero_hpz_partition_size runs: it needs process groups, no kernel. On 4 CPU ranks with
      hpz_partition_size=2 (and stage-3 parameters re-gathered for backward) the backward all-gathers
      read the secondary copy over 2-rank groups: shards twice the size, same losses as without hpZ.
      helpers.config refuses it on a CPU all the same, with the quantized features.
    """
    extra = zeropp_block(a.zeropp, a.hpz)
    result = {"features": a.zeropp, "zero_extra": extra, "ran": False, "failed_in": None, "error": None, "where": None, "losses": []}
    config = run_config(a, 3, n_params, zero_extra=extra)
    save_config(a.out, "zeropp", config)
    try:
        trainer = AdvancedDeepSpeedTrainer(data, config, model_size=a.model_size,
                                           seed=a.seed, output_dir=f"{a.out}/zeropp")
    except ConfigError as err:   # the validator stops it before DeepSpeed (on a CPU)
        return {**result, "failed_in": "helpers.config.validate", "error": f"ConfigError: {err}"}
    except Exception as err:  # noqa: BLE001 - DeepSpeed's own failure, whatever its type, is the result
        return {**result, **describe_failure(err, "deepspeed.initialize")}
    world = trainer.engine.world_size
    try:
        trainer.train(1, progress=False)
        logged = log_one_step(trainer)
        trainer.train(max(0, a.steps - 2), progress=False)
    except Exception as err:  # noqa: BLE001 - as above
        losses = [m["loss"] for m in trainer.history]
        return {**result, **describe_failure(err, f"step {trainer.step + 1}"), "losses": losses}
    as_read = {k: getattr(trainer.engine, k)() for k in extra}   # what DeepSpeed itself took from the config
    return {**result, "ran": True, "engine_read": as_read, "losses": [m["loss"] for m in trainer.history],
            "precision": trainer.precision, "device": str(trainer.engine.device), "world_size": world,
            "comm_logged": logged, "comm_sent_bytes": comms.sent_bytes(logged, world)}


def describe_failure(err: Exception, when: str) -> dict:
    """Where DeepSpeed failed, in words: the phase, the engine call it was in, its last runtime frame."""
    frames = traceback.extract_tb(err.__traceback__)
    calls = [f.name for f in frames if f.filename.endswith("deepspeed/runtime/engine.py")
             and f.name in ("forward", "backward", "step")]
    runtime = [f for f in frames if "/deepspeed/runtime/" in f.filename]
    last = runtime[-1] if runtime else None
    where = f"{last.filename.split('/deepspeed/')[-1]}:{last.lineno} in {last.name}: {last.line}" if last else None
    return {"failed_in": when + (f" ({calls[0]})" if calls else ""),
            "error": f"{type(err).__name__}: {err}", "where": where}


if __name__ == "__main__":
    main()
