"""AdvancedDeepSpeedTrainer: bad input stopped before deepspeed.initialize, learning, exact resume."""
import deepspeed
import pytest
import torch

from helpers.config import build_config
from helpers.errors import ConfigError
from helpers.data import SyntheticTextDataset
from helpers.export import read_tensorboard
from helpers.runtime import detect
from helpers.model import build_model, generate
from helpers.checkpoints import CheckpointNotFoundError
from helpers.trainer import AdvancedDeepSpeedTrainer
from tests.trainers import make_trainer


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=256, seq_len=32, seed=0)


def small(data, tmp_path, **kw):
    args = dict(micro_batch=8, warmup_steps=2, total_steps=40, output_dir=tmp_path,
                tensorboard_dir=tmp_path / "tensorboard")
    return make_trainer(data, **{**args, **kw})


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if anything reaches deepspeed.initialize: errors must come first."""
    def refuse(*a, **k):
        raise AssertionError("deepspeed.initialize was called before the bad input was caught")
    monkeypatch.setattr(deepspeed, "initialize", refuse)


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(n_positions=16), ValueError, "n_positions=16"),
    (dict(lr=0.0), ConfigError, "optimizer.params.lr=0.0"),
    (dict(lr=-1.0), ConfigError, "optimizer.params.lr=-1.0"),
    (dict(precision="fp16"), ConfigError, "fp16"),
    (dict(zero_stage=5), ConfigError, "zero_optimization.stage=5"),
    (dict(micro_batch=0), ConfigError, "train_micro_batch_size_per_gpu=0"),
    (dict(warmup_steps=50, total_steps=10), ConfigError, "total_num_steps=10"),
    (dict(model_size="huge"), ValueError, "model_size='huge'"),
    (dict(micro_batch=512), ValueError, "fewer than one global micro-batch"),
])
def test_bad_input_is_caught_before_the_engine(data, tmp_path, no_engine, kwargs, error, field):
    with pytest.raises(error) as err:
        small(data, tmp_path, **kwargs)
    assert field in str(err.value)


def test_resume_from_an_empty_directory_is_an_error(data, tmp_path, no_engine):
    with pytest.raises(CheckpointNotFoundError, match="no DeepSpeed checkpoint in"):
        small(data, tmp_path, resume_from=tmp_path)


def test_resume_from_a_missing_tag_is_an_error(data, tmp_path, no_engine):
    (tmp_path / "latest").write_text("step7")
    with pytest.raises(CheckpointNotFoundError, match="step7"):
        small(data, tmp_path, resume_from=tmp_path)


@pytest.mark.precision   # in the rule's precision: run again with the other one forced
def test_trains_and_resumes_exactly(data, tmp_path):
    straight = small(data, tmp_path / "a")
    first = straight.train(10, progress=False)
    ckpt = straight.save_checkpoint()
    rest = straight.train(10, progress=False)
    assert rest[-1]["loss"] < first[0]["loss"] - 0.5          # it learns
    resumed = small(data, tmp_path / "b", resume_from=ckpt.parent)
    assert resumed.step == 10 and resumed.batches.position == 10
    again = resumed.train(10, progress=False)
    assert [m["loss"] for m in again] == [m["loss"] for m in rest]   # bitwise on CPU
    assert [m["lr"] for m in again] == [m["lr"] for m in rest]


def test_generate_returns_known_words(data, tmp_path):
    model = build_model(data.vocab_size, data.seq_len, "tiny", data.tokenizer.pad_token_id)
    text = generate(model, data.tokenizer, data.source.words[0], max_new_tokens=10)
    assert len(text.split()) == 11 and all(w in data.source.index for w in text.split())


def test_resume_with_a_different_dataset_size_is_refused(data, tmp_path):
    from helpers.batches import ResumableBatches
    saved = ResumableBatches(data, 8, seed=0).state_dict()
    smaller = SyntheticTextDataset("markov", n_samples=128, seq_len=32, seed=0, tokenizer=data.tokenizer)
    with pytest.raises(ValueError, match="dataset size"):
        ResumableBatches(smaller, 8, seed=0).load_state_dict(saved)


def test_cpu_defaults_fused_adamw_and_no_bucket_on_one_rank():
    assert not detect().is_gpu   # these are the CPU defaults
    config = {stage: build_config(micro_batch=8, zero_stage=stage, device="cpu") for stage in (0, 1, 2, 3)}
    for stage, c in config.items():
        assert c["optimizer"]["params"]["torch_adam"] and c["optimizer"]["params"]["fused"], stage
        assert ("contiguous_gradients" in c["zero_optimization"]) == (stage in (1, 2)), stage
    assert config[2]["zero_optimization"]["contiguous_gradients"] is False
    # the caller's choices win over the defaults
    mine = build_config(micro_batch=8, zero_stage=2, zero_extra={"contiguous_gradients": True}, device="cpu")
    assert mine["zero_optimization"]["contiguous_gradients"] is True
    offload = build_config(micro_batch=8, zero_stage=2, offload_optimizer=True, device="cpu")
    assert "fused" not in offload["optimizer"]["params"]   # DeepSpeedCPUAdam, not torch's AdamW
    assert build_config(zero_stage=1, device="cpu", world_size=2)["zero_optimization"] == {"stage": 1}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_gpu_config_asks_for_no_optimizer_that_needs_a_cuda_build(precision):
    """DeepSpeed's FusedAdam is JIT-built with nvcc on first use (a Colab failure when nvcc's CUDA is not torch's);
    the trainer's GPU configs ask for torch's fused AdamW at every stage, DeepSpeedCPUAdam where offloaded."""
    for stage in (0, 1, 2, 3):
        params = build_config(zero_stage=stage, precision=precision, device="cuda")["optimizer"]["params"]
        assert params["torch_adam"] and params["fused"], stage
    offload = build_config(zero_stage=2, precision=precision, offload_optimizer=True, device="cuda")
    assert "torch_adam" not in offload["optimizer"]["params"]


# build_config's AdamW without torch_adam: DeepSpeed's FusedAdam, under its FP16_Optimizer wrapper at ZeRO 0
FUSED_ADAM = build_config(lr=3e-3, torch_adam=False)["optimizer"]


@pytest.mark.parametrize("optimizer", [None, FUSED_ADAM], ids=["torch-adamw", "deepspeed-fusedadam"])
def test_zero0_in_bf16_starts_adam_at_step_zero_like_zero1(data, tmp_path, optimizer):
    """DeepSpeed's bf16 wrappers at ZeRO 0 step their optimizer once on zero gradients when built; the trainer
    undoes that step, so ZeRO 0 trains as ZeRO 1 does (a separate DeepSpeed code path, without that step)."""
    extra = {"optimizer": optimizer} if optimizer else None
    zero0 = small(data, tmp_path / "z0", precision="bf16", zero_stage=0, extra=extra)
    wrapper = zero0.engine.optimizer
    if optimizer:   # FP16_Optimizer: one flat fp32 master per group
        masters, weights = wrapper.fp32_groups_flat, wrapper.fp16_groups_flat
    else:           # FP16_UnfusedOptimizer: one fp32 master per parameter
        masters, weights = sum(wrapper.fp32_groups, []), sum(wrapper.fp16_groups, [])
    assert all(torch.equal(m, w.float()) for m, w in zip(masters, weights))   # no weight decay applied yet
    zero0.train(6, progress=False)
    assert {int(state["step"]) for state in wrapper.optimizer.state.values()} == {6}   # the optimizer's own count
    zero1 = small(data, tmp_path / "z1", precision="bf16", zero_stage=1, extra=extra)
    zero1.train(6, progress=False)
    first, second = ([m["loss"] for m in t.history] for t in (zero0, zero1))
    assert max(abs(a - b) for a, b in zip(first, second)) < 5e-3, (first, second)   # 4e-4 here; 0.05 with the step


def test_one_rank_skips_the_allreduce_and_every_step_reaches_tensorboard(data, tmp_path, monkeypatch):
    trainer = small(data, tmp_path)
    calls = []
    monkeypatch.setattr(trainer.engine, "allreduce_gradients", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(AdvancedDeepSpeedTrainer, "LOG_EVERY", 3)   # 7 steps: two batched writes and a rest
    history = trainer.train(7, progress=False)
    assert calls == []   # engine.no_sync(): nothing to average on one rank
    steps, losses = read_tensorboard(trainer.tensorboard_logdir)["train/loss"]
    assert steps == list(range(1, 8)) and losses == pytest.approx([m["loss"] for m in history])
