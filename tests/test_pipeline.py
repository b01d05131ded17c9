"""helpers.topics.pipeline, helpers.topics.pipeline_schedule and helpers/programs/pipeline.py: the bubble formula against DeepSpeed's own schedule,
parameter counts against GPT-2's, and one real 2-stage run against the same model trained unsplit."""
import pytest
import torch

from helpers.topics import pipeline
from helpers.topics.pipeline import layer_param_formula, stage_param_formula
from helpers.topics.pipeline_schedule import (COMPUTE, bubble_fraction, bubble_rows, handoff_delays, measured_bubble,
                                              micro_batch_ids, replay_schedule, schedule_table, scheduled_bubble, train_schedule)
from helpers.programs.pipeline import UnsplitModel, build_pipeline, gpt2_config, gpt2_layer_specs, layer_names
from helpers.runtime import init_single_process
from helpers.model import gpt2_param_count

CONFIG = gpt2_config(vocab_size=50, n_positions=16, n_layer=3, n_embd=32, n_head=4)


# ---- the bubble formula and DeepSpeed's schedule ----

@pytest.mark.parametrize("stages, micro_batches, expected", [
    (1, 1, 0.0), (1, 8, 0.0), (2, 1, 1 / 2), (2, 4, 1 / 5), (2, 8, 1 / 9), (4, 4, 3 / 7), (8, 32, 7 / 39)])
def test_bubble_fraction_values(stages, micro_batches, expected):
    assert bubble_fraction(stages, micro_batches) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("stages, micro_batches, problem", [
    (0, 4, "stages=0"), (2, 0, "micro_batches=0"), (-1, 4, "stages=-1"), (2.0, 4, "stages=2.0"),
    (2, "4", "micro_batches='4'"), (True, 4, "stages=True")])
def test_bubble_fraction_rejects_bad_input(stages, micro_batches, problem):
    with pytest.raises(ValueError, match=problem):
        bubble_fraction(stages, micro_batches)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 5, 8])
def test_deepspeed_schedule_runs_every_micro_batch_once_forward_and_backward(stages, micro_batches):
    for row in schedule_table(stages, micro_batches):
        work = [slot for slot in row if slot]
        assert sorted(work) == sorted([f"F{k}" for k in range(micro_batches)] + [f"B{k}" for k in range(micro_batches)])
        assert [s for s in work if s[0] == "F"] == [f"F{k}" for k in range(micro_batches)]   # in order
        assert [s for s in work if s[0] == "B"] == [f"B{k}" for k in range(micro_batches)]


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 5, 8])
def test_deepspeed_schedule_idles_exactly_the_formula(stages, micro_batches):
    """TrainSchedule has 2(m+p-1) slots per stage, 2m of them busy: the formula, from DeepSpeed's own code."""
    expected = bubble_fraction(stages, micro_batches)
    assert scheduled_bubble(stages, micro_batches) == pytest.approx([expected] * stages, abs=1e-12)


def test_schedule_of_two_stages_is_one_forward_one_backward():
    assert schedule_table(2, 3) == [["F0", "", "F1", "B0", "F2", "B1", "", "B2"],
                                    ["", "F0", "B0", "F1", "B1", "F2", "B2", ""]]


def test_micro_batch_ids_follow_forward_and_backward_order():
    names = ["LoadMicroBatch", "ForwardPass", "SendActivation", "LoadMicroBatch", "ForwardPass", "RecvGrad",
             "SendActivation", "BackwardPass", "RecvGrad", "BackwardPass", "OptimizerStep"]
    assert micro_batch_ids(names) == [0, 0, 0, 1, 1, 0, 1, 0, 1, 1, None]


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 3, 8])
@pytest.mark.parametrize("forward, backward", [(1.0, 1.0), (1.0, 2.0)])
def test_replay_of_equal_stages_gives_the_formula(stages, micro_batches, forward, backward):
    events = replay_schedule([[forward] * micro_batches] * stages, [[backward] * micro_batches] * stages)
    idle = [row["idle_fraction"] for row in measured_bubble(events)]
    assert idle == pytest.approx([bubble_fraction(stages, micro_batches)] * stages, abs=1e-12)


def test_replay_of_a_slow_last_stage_makes_the_first_one_wait():
    # Stage 1 needs 6 units per micro-batch, stage 0 only 3: the pipeline runs at stage 1's pace. Span =
    # stage 0's F0 (1) + 4 x 6 on stage 1 + stage 0's last backward (2) = 27; stage 0 computes 12 of it.
    events = replay_schedule([[1.0] * 4, [2.0] * 4], [[2.0] * 4, [4.0] * 4])
    rows = measured_bubble(events)
    assert rows[0]["span_s"] == pytest.approx(27)
    assert [r["idle_fraction"] for r in rows] == pytest.approx([15 / 27, 3 / 27])


def test_handoff_delays_recover_the_hand_off_time_a_replay_was_given():
    events = replay_schedule([[1.0] * 3] * 2, [[2.0] * 3] * 2, handoff_s=0.25)
    first_forward_on_stage1 = next(e for e in events[1] if e["name"] == "ForwardPass")
    assert first_forward_on_stage1["start"] == pytest.approx(1.0 + 0.25)
    delays = handoff_delays(events)
    assert len(delays) >= 3 and delays == pytest.approx([0.25] * len(delays))
    without = measured_bubble(replay_schedule([[1.0] * 3] * 2, [[2.0] * 3] * 2))
    assert all(a["idle_fraction"] > b["idle_fraction"] for a, b in zip(measured_bubble(events), without))


def test_deepspeed_sends_the_next_activation_only_after_the_gradient_came_back():
    """TrainSchedule puts RecvGrad(k) before SendActivation(k+1) in one slot of stage 0, so stage 1's
    forward k+1 waits for two hand-offs in a row: the gradient going back, then the activation."""
    events = replay_schedule([[1.0] * 3] * 2, [[2.0] * 3] * 2, handoff_s=0.25)
    done = {(s, e["name"], e["mb"]): e for s, stage in enumerate(events) for e in stage}
    stage1_free = done[(1, "BackwardPass", 0)]["end"]
    assert done[(1, "ForwardPass", 1)]["start"] == pytest.approx(stage1_free + 2 * 0.25)


def test_timeline_plot_draws_every_forward_and_backward():
    import matplotlib
    matplotlib.use("Agg")
    from helpers.plots import pipeline_timeline
    ax = pipeline_timeline(replay_schedule([[1.0] * 3] * 2, [[2.0] * 3] * 2)).axes[0]
    assert len(ax.patches) == 2 * 2 * 3
    assert sorted(t.get_text() for t in ax.texts) == sorted([f"{k}{i}" for k in "FB" for i in range(3)] * 2)


# ---- the model: layers, parameter counts, and that it is GPT-2 ----

def test_layers_are_embeddings_blocks_norm_and_tied_head():
    assert layer_names(gpt2_layer_specs(CONFIG)) == [
        "TokenEmbedding", "PositionEmbedding", "GPT2Block", "GPT2Block", "GPT2Block", "LayerNorm",
        "lm_head (tied to TokenEmbedding)"]


def test_layer_param_formula_matches_the_built_layers():
    built = [sum(p.numel() for p in spec.build().parameters()) for spec in gpt2_layer_specs(CONFIG)]
    assert built == layer_param_formula(CONFIG)


def test_one_stage_holds_gpt2_with_tied_embeddings():
    from transformers import GPT2LMHeadModel
    specs = gpt2_layer_specs(CONFIG)
    [whole] = stage_param_formula(specs, [0, len(specs)], layer_param_formula(CONFIG))
    assert whole == gpt2_param_count(50, 16, 3, 32) == GPT2LMHeadModel(CONFIG).num_parameters()


def test_two_stages_hold_the_tied_embedding_twice():
    from deepspeed.runtime.utils import partition_balanced
    specs, per_layer = gpt2_layer_specs(CONFIG), layer_param_formula(CONFIG)
    parts = [int(p) for p in partition_balanced(per_layer, 2)]   # DeepSpeed's partition_method="parameters"
    stages = stage_param_formula(specs, parts, per_layer)
    assert sum(stages) == gpt2_param_count(50, 16, 3, 32) + CONFIG.vocab_size * CONFIG.n_embd


def test_unsplit_model_computes_exactly_what_gpt2_computes():
    """Copy the pipeline layers' weights into transformers' GPT2LMHeadModel: same logits, so the layer
    list is GPT-2 (causal attention, tied head) and not merely GPT-2-sized."""
    from transformers import GPT2LMHeadModel
    init_single_process()
    model = UnsplitModel(gpt2_layer_specs(CONFIG), seed=3).eval()
    gpt2 = GPT2LMHeadModel(CONFIG).eval()
    missing = gpt2.load_state_dict(as_gpt2_names(model.layers.state_dict(), CONFIG.n_layer), strict=False)
    assert missing.unexpected_keys == [] and set(missing.missing_keys) <= {"lm_head.weight"}   # tied to wte
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.layers(ids), gpt2(ids).logits, rtol=0, atol=1e-5)


def as_gpt2_names(ours: dict, n_layer: int) -> dict:
    """PipelineModule's names (layer index, tied_modules.<key>) -> GPT2LMHeadModel's."""
    theirs = {"transformer.wte.weight": ours["tied_modules.token_embedding.weight"],
              "transformer.wpe.weight": ours["1.wpe.weight"],
              "transformer.ln_f.weight": ours[f"{2 + n_layer}.weight"],
              "transformer.ln_f.bias": ours[f"{2 + n_layer}.bias"]}
    for name, tensor in ours.items():
        layer, rest = name.split(".", 1)
        if layer.isdigit() and 2 <= int(layer) < 2 + n_layer:   # layers 2.. are the blocks
            theirs[f"transformer.h.{int(layer) - 2}.{rest}"] = tensor
    return theirs


def test_same_seed_same_weights_different_seed_different_weights():
    init_single_process()
    a, b, c = (UnsplitModel(gpt2_layer_specs(CONFIG), seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.2.attn.c_attn.weight"], c["layers.2.attn.c_attn.weight"])


def test_unknown_partition_method_is_named():
    with pytest.raises(ValueError, match="partition_method='type:Block'"):
        build_pipeline(gpt2_layer_specs(CONFIG), 1, partition_method="type:Block")


@pytest.mark.parametrize("micro_batches, problem", [((0,), "argument --micro-batches: 0 must be at least 1"), ((2, 2), "repeats a value")])
def test_run_rejects_bad_micro_batches_before_launching(tmp_path, micro_batches, problem):
    with pytest.raises(ValueError, match=problem):
        pipeline.run(micro_batches, out_dir=tmp_path)
    assert not any(tmp_path.iterdir())   # nothing was launched


# ---- one real 2-rank pipeline run against the unsplit run ----

MICRO_BATCHES = (1, 3)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pipeline.run(MICRO_BATCHES, out_dir=tmp_path_factory.mktemp("pipeline"), steps=3,
                        micro_batch=2, seq_len=32, timeout=300)


def test_stages_split_the_layers_and_their_parameters(results):
    rank = results["ranks"][0]
    n_layers = len(rank["layer_param_formula"])
    for m in MICRO_BATCHES:
        stage0, stage1 = sorted(results["pipeline"][m], key=lambda r: r["stage"])
        assert [*stage0["layers"], *stage1["layers"]] == [0, stage0["layers"][1], stage0["layers"][1], n_layers]
        assert 0 < stage0["layers"][1] < n_layers   # each stage holds some layers, together all of them
        assert [s["n_params"] for s in (stage0, stage1)] == [s["params_formula"] for s in (stage0, stage1)]
        tied_copy = rank["vocab_size"] * rank["model"]["n_embd"]
        unique = gpt2_param_count(rank["vocab_size"], rank["model"]["n_positions"], rank["model"]["n_layer"],
                                  rank["model"]["n_embd"])
        assert stage0["n_params"] + stage1["n_params"] - tied_copy == unique == results["unsplit"][m]["n_params"]
        assert stage0["tied_params"] == stage1["tied_params"] == tied_copy


def test_pipeline_loss_matches_the_unsplit_model(results):
    rows = {row["m"]: row for row in pipeline.parity_rows(results)}
    for m in MICRO_BATCHES:
        assert rows[m]["max |loss difference|"] <= 1e-6
        assert rows[m]["tied copies max |difference|"] == 0.0   # DeepSpeed keeps the two copies identical
        # Summation order is the only difference: the tied weight's gradient adds embedding and head
        # parts per micro-batch unsplit, per stage in the pipeline. With one micro-batch both are a + b.
        assert rows[m]["max |weight difference|"] <= (0.0 if m == 1 else 1e-4)


def test_timer_saw_deepspeeds_schedule_instruction_by_instruction(results):
    for m in MICRO_BATCHES:
        for stage_result in results["pipeline"][m]:
            expected = [name for slot in train_schedule(2, m)[stage_result["stage"]] for name in slot]
            for step in stage_result["events"]:
                assert [e["name"] for e in step] == expected


def test_measured_timeline_respects_the_data_dependencies(results):
    """Causality across the two processes: stage 1 starts forward k after stage 0 finished it, stage 0
    starts backward k after stage 1 finished it (the ranks share one monotonic clock)."""
    for m in MICRO_BATCHES:
        stage0, stage1 = sorted(results["pipeline"][m], key=lambda r: r["stage"])
        for events0, events1 in zip(stage0["events"], stage1["events"]):
            done = {(s, e["name"], e["mb"]): e for s, events in ((0, events0), (1, events1)) for e in events
                    if e["name"] in COMPUTE}
            for k in range(m):
                assert done[(1, "ForwardPass", k)]["start"] >= done[(0, "ForwardPass", k)]["end"]
                assert done[(0, "BackwardPass", k)]["start"] >= done[(1, "BackwardPass", k)]["end"]


def test_bubble_rows_put_formula_schedule_and_measurement_side_by_side(results):
    rows = bubble_rows(results)
    assert [(r["m"], r["stage"]) for r in rows] == [(m, s) for m in MICRO_BATCHES for s in (0, 1)]
    for row in rows:
        assert row["schedule idle slots"] == pytest.approx(row["bubble formula"])
        for key in ("idle measured", "idle replayed", "idle replayed + hand-offs"):
            assert 0 <= row[key] < 1
        assert row["hand-off ms"] >= 0
