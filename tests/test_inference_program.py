"""helpers/programs/inference.py without launching ranks: its option checks, the printed command, the ZeRO-Inference
config and the generation helpers on one small model (notebook 08's run covers the real launch)."""
import pytest
import torch

from helpers import REPO_ROOT
from helpers.errors import InputError
from helpers.launch import checked_flags, command_line
from helpers.programs import inference
from helpers.schema import check_with_deepspeed_config


@pytest.mark.parametrize("n_ranks, options, message", [
    (2, {"tp_size": 3}, "tp_size=3 is not the 2 ranks"),
    (4, {"tp_size": 2}, "tp_size=2 is not the 4 ranks"),
    (4, {"tp_size": 4, "model_size": "base"}, "does not divide the 6 attention heads"),
    (2, {"weights": "no/such/file.bin"}, "weights='no/such/file.bin' is not a file"),
    (2, {"model": "gpt2"}, "parts=autotp with model=gpt2: DeepSpeed's AutoTP refuses GPT-2"),
    (3, {"model": "gpt2", "parts": ["zero"], "tp_size": 2}, None),   # no AutoTP part: tp_size is not asked about
])
def test_what_deepspeed_would_refuse_or_hang_on_is_refused_before_any_rank_starts(n_ranks, options, message, tmp_path):
    if message is None:
        checked_flags("inference", n_ranks, "torchrun", tmp_path, options)
        return
    with pytest.raises(ValueError, match=message):
        checked_flags("inference", n_ranks, "torchrun", tmp_path, options)


def test_weights_of_other_sizes_are_refused_naming_the_sizes_and_fitting_ones_load_bitwise(tmp_path):
    from helpers.model import build_llama, build_model
    saved = build_model(64, 32, "tiny", seed=1).to(torch.bfloat16)   # 16-bit, as save_16bit_model writes it
    torch.save(saved.state_dict(), tmp_path / "w.bin")
    weights = {"model": "gpt2", "parts": ["zero"], "vocab": 64, "weights": str(tmp_path / "w.bin")}
    with pytest.raises(ValueError, match="do not fit model=gpt2 model_size=small vocab=64: give the sizes it was trained"):
        checked_flags("inference", 2, "torchrun", tmp_path, {**weights, "model_size": "small"})
    llama = build_llama(64, 32, "tiny", seed=1)
    torch.save(llama.state_dict(), tmp_path / "llama.bin")
    with pytest.raises(ValueError, match="hold no GPT-2 position table"):
        checked_flags("inference", 2, "torchrun", tmp_path, {**weights, "weights": str(tmp_path / "llama.bin")})
    _, args = checked_flags("inference", 2, "torchrun", tmp_path, weights)
    loaded = inference.load_model(inference.parse(["--out", str(tmp_path), *args]))
    assert loaded.transformer.wpe.weight.shape[0] == 32   # positions from the file, not prompt + new tokens
    assert all(torch.equal(p.to(torch.bfloat16), q) for p, q in zip(loaded.parameters(), saved.parameters()))


@pytest.mark.parametrize("options, message", [
    ({"new_tokens": 0}, "0 must be at least 1"),
    ({"precision": "fp8"}, "invalid choice: 'fp8'"),
    ({"model_size": "huge"}, "invalid choice: 'huge'"),
])
def test_a_bad_flag_is_named_by_the_programs_own_parser(options, message, tmp_path):
    with pytest.raises(InputError, match=message):
        checked_flags("inference", 2, "torchrun", tmp_path, options)


def test_the_printed_command_runs_from_the_repository_root():
    out = REPO_ROOT / "runs" / "x"
    module, args = checked_flags("inference", 2, "torchrun", out, {"new_tokens": 8, "precision": "fp32"})
    assert command_line(module, 2, out, args) == \
        "torchrun --nproc_per_node 2 -m helpers.programs.inference --out runs/x --new-tokens=8 --precision=fp32"
    weights = REPO_ROOT / "runs" / "zero3" / "16bit" / "pytorch_model.bin"   # a path option, as section 4 passes one
    assert command_line(module, 2, out, [f"--weights={weights}", "--parts", "zero"]).endswith(
        "--out runs/x --weights=runs/zero3/16bit/pytorch_model.bin --parts zero")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_zero_inference_config_is_stage_3_offloaded_without_an_optimizer_and_deepspeed_accepts_it(precision):
    config = inference.zero_inference_config(precision)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert "optimizer" not in config and "scheduler" not in config
    assert ("bf16" in config) == (precision == "bf16")
    check_with_deepspeed_config(config)   # raises ConfigError if DeepSpeed's own config class refuses it


def test_the_teacher_forced_choices_are_the_greedy_tokens_of_the_same_model(tmp_path):
    a = inference.parse(["--out", str(tmp_path), "--vocab", "64", "--prompt-len", "4", "--new-tokens", "5"])
    model = inference.load_model(a)
    ids = torch.randint(a.vocab, (2, a.prompt_len), generator=torch.Generator().manual_seed(0))
    tokens, speed = inference.timed_generate(model, ids, a.new_tokens)
    choices, margins = inference.teacher_forced(model, ids, tokens)
    assert [len(t) for t in tokens] == [5, 5] and speed > 0
    assert choices.tolist() == tokens   # one forward over prompt + tokens picks what generate picked step by step
    assert (margins >= 0).all()


def test_weights_saved_in_16_bit_load_over_the_seeded_model(tmp_path):
    a = inference.parse(["--out", str(tmp_path), "--vocab", "64", "--seed", "1"])
    trained = inference.load_model(a)
    path = tmp_path / "model.bin"
    torch.save({k: v.bfloat16() for k, v in trained.state_dict().items()}, path)   # as save_16bit_model writes it
    a = inference.parse(["--out", str(tmp_path), "--vocab", "64", "--seed", "2", "--weights", str(path)])
    loaded = inference.load_model(a)
    weight = loaded.model.embed_tokens.weight
    assert torch.equal(weight, trained.model.embed_tokens.weight.bfloat16().float())


def test_prompts_from_the_data_are_sentence_starts_of_zero3s_language_and_read_back_as_its_words(tmp_path):
    a = inference.parse(["--out", str(tmp_path), "--model", "gpt2", "--parts", "zero", "--prompts", "data",
                         "--prompt-len", "5"])
    ids, probe, tokenizer = inference.prompts(a)
    data = inference.prompt_data(a)   # what helpers.programs.zero3 trains on, with its defaults
    assert torch.equal(ids, torch.stack([data[i]["input_ids"][:5] for i in range(a.batch)]))
    assert probe.shape == ids.shape and not torch.equal(probe, ids)
    texts = inference.texts(tokenizer, ids, [[0, 1], [2, 3]], {"zero": {"tokens": [[0, 1], [2, 3]]}})
    assert [len(t.split()) for t in texts["prompt"]] == [5, 5] and texts["zero"] == texts["plain"]
    random_ids, _, none = inference.prompts(inference.parse(["--out", str(tmp_path)]))
    assert none is None and inference.texts(none, random_ids, [], {}) is None


def test_prompts_from_the_data_need_a_vocabulary_that_holds_its_words(tmp_path):
    with pytest.raises(ValueError, match="prompts=data with vocab=64: the data has"):
        checked_flags("inference", 2, "torchrun", tmp_path, {"model": "gpt2", "parts": ["zero"], "prompts": "data",
                                                             "vocab": 64})
