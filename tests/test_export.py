"""helpers.export: DeepSpeed checkpoints of every ZeRO stage become HF models that give the engine's
logits and generate through a text-generation pipeline. (A 2-rank ZeRO-3
checkpoint written by helpers/programs/train.py under torchrun is exported in test_train_cli.py.)"""
import pytest
import torch
from transformers import pipeline

from helpers import export
from helpers.data import SyntheticTextDataset
from helpers.model import build_model
from tests.trainers import make_trainer


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=64, seq_len=16, seed=0)


def trained(data, tmp_path, stage, precision="fp32"):
    trainer = make_trainer(data, zero_stage=stage, precision=precision, micro_batch=4, warmup_steps=1, total_steps=10,
                           output_dir=tmp_path)
    trainer.train(3, progress=False)   # DeepSpeed's warmup takes >= 2 steps, the first ones at lr 0
    return trainer


@pytest.fixture(scope="module")
def exported(data, tmp_path_factory):
    """(trainer, checkpoint, HF directory) for a ZeRO stage and precision, each trained and exported once."""
    runs = {}

    def get(stage, precision="fp32"):
        if (stage, precision) not in runs:
            tmp = tmp_path_factory.mktemp(f"zero{stage}_{precision}")
            trainer = trained(data, tmp, stage, precision)
            checkpoint = trainer.save_checkpoint(tmp / "checkpoints")
            hf_dir = export.export_hf(checkpoint.parent, tmp / "hf", trainer.tokenizer, trainer.engine.module.config)
            runs[stage, precision] = trainer, checkpoint, hf_dir
        return runs[stage, precision]
    return get


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")])
def test_export_gives_the_engines_logits(data, exported, stage, precision):
    trainer, checkpoint, hf_dir = exported(stage, precision)
    ids = data[0]["input_ids"][None]
    assert export.max_logit_difference(hf_dir, trainer.engine, ids) <= 1e-5   # measured: 0.0 at every stage
    initial = build_model(data.vocab_size, 16, "tiny", data.tokenizer.pad_token_id, seed=0)
    exported_weights = export.fp32_state_dict(checkpoint.parent)
    # training moved the weights: the logits match is not two untrained models agreeing
    assert not torch.equal(exported_weights["transformer.h.0.attn.c_attn.weight"],
                           initial.state_dict()["transformer.h.0.attn.c_attn.weight"])


@pytest.mark.parametrize("stage", [0, 3])
def test_pipeline_generates_what_the_engine_generates(data, exported, stage):
    trainer, _, hf_dir = exported(stage)
    prompt = " ".join(data.texts[1].split()[:4])
    trainer.engine.eval()
    with torch.no_grad():
        ids = trainer.tokenizer(prompt, return_tensors="pt")["input_ids"]
        greedy = trainer.engine.module.generate(ids, max_new_tokens=8, do_sample=False,
                                                pad_token_id=trainer.tokenizer.pad_token_id)
    generator = pipeline("text-generation", model=str(hf_dir), tokenizer=str(hf_dir))   # as notebook 03 runs it
    pad = generator.tokenizer.pad_token_id
    text = generator(prompt + " ", max_new_tokens=8, do_sample=False, pad_token_id=pad,
                     suppress_tokens=[pad])[0]["generated_text"]
    # The same words; the spaces between prompt and continuation are the pipeline's: transformers 5.9+ decodes the
    # new tokens alone (no leading space: hence the prompt's trailing one), 5.3-5.8 cut the whole text's decoding
    # after the prompt's, which keeps a space there too.
    assert text.split() == trainer.tokenizer.decode(greedy[0], skip_special_tokens=True).split()
    assert len(text.split()) == 4 + 8   # word-level tokenizer: one token per word


def test_checkpoint_without_saved_config_names_what_to_pass(data, exported, tmp_path):
    trainer, checkpoint, _ = exported(0)   # saved by the trainer itself: no config.json or tokenizer beside it
    with pytest.raises(FileNotFoundError, match="pass tokenizer= and model_config="):
        export.export_hf(checkpoint.parent, tmp_path / "hf")
    wrong = build_model(data.vocab_size, 16, "tiny").config
    wrong.n_layer = 3   # one block more than was trained
    with pytest.raises(ValueError, match=r"missing \['transformer.h.2"):
        export.export_hf(checkpoint.parent, tmp_path / "hf", trainer.tokenizer, wrong)


def test_not_a_checkpoint_is_named(tmp_path):
    (tmp_path / "latest").write_text("step1")
    (tmp_path / "step1").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*model_states.pt"):
        export.fp32_state_dict(tmp_path)
