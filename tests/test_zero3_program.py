"""Notebook 08's ZeRO-3 program without launching ranks (nbval runs the notebook, whose check cells hold the
2-rank run against the shapes, the ranks' own partitions and zero_to_fp32): every knob setting is a config
DeepSpeed's own models accept, asking for the 16-bit save; a wrong setting name is refused before any rank
starts, naming the choices."""
import pytest

from helpers.errors import InputError
from helpers.launch import checked_flags
from helpers.programs import zero3


@pytest.mark.parametrize("name", sorted(zero3.KNOBS))
def test_every_knob_setting_is_a_config_deepspeed_accepts(name):
    a = zero3.parse(["--out", "x", "--knobs", name])
    config = zero3.zero3_config(a, "fp32", 2, zero3.KNOBS[name])
    block = config["zero_optimization"]
    assert block["stage"] == 3 and block["stage3_gather_16bit_weights_on_model_save"] is True
    assert {k: block[k] for k in zero3.KNOBS[name]} == zero3.KNOBS[name]


def test_a_misspelt_knob_key_is_refused_by_deepspeeds_own_model():
    a = zero3.parse(["--out", "x"])
    with pytest.raises(ValueError, match="stage3_max_live_param"):
        zero3.zero3_config(a, "fp32", 2, {"stage3_max_live_param": 0})


def test_an_unknown_setting_is_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(InputError, match="invalid choice: 'fewlive'"):
        checked_flags("zero3", 2, "torchrun", tmp_path, {"knobs": ["fewlive"]})


def test_the_plain_build_holds_the_models_fp32_bytes_and_a_moment_of_one_weight_more():
    a = zero3.parse(["--out", "x", "--model-size", "tiny", "--vocab", "512"])
    built = zero3.plain_build(a)
    model = zero3.build_model(a.vocab, a.seq_len, a.model_size, seed=a.seed)
    params = list(model.parameters())   # the tied LM head once
    assert built["end"] == sum(4 * p.numel() for p in params)   # PyTorch builds in fp32
    assert built["end"] <= built["peak"] <= built["end"] + 4 * max(p.numel() for p in params)
