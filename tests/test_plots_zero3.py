"""Notebook 08's figures (in helpers/plots.py): each draws every row it is given and saves a PNG."""
from helpers.plots import knob_tradeoff, memory_tiers


def test_the_knob_figure_labels_every_setting_once_sharing_a_point_where_they_coincide(tmp_path):
    rows = [{"setting": "defaults", "all-gather MB": 4.0, "peak whole in a step": 4_224_512, "all-gathers": 40},
            {"setting": "few_live", "all-gather MB": 10.1, "peak whole in a step": 1_048_576, "all-gathers": 56},
            {"setting": "no_prefetch", "all-gather MB": 4.0, "peak whole in a step": 4_224_512, "all-gathers": 27}]
    fig = knob_tradeoff(rows, save_dir=tmp_path)
    ax = fig.axes[0]   # settings on the same point share one label
    assert len(ax.collections) == 2
    assert [t.get_text() for t in ax.texts] == ["defaults (40 calls)\nno_prefetch (27 calls)", "few_live (56 calls)"]
    assert (tmp_path / "figures" / "zero3_knobs.png").is_file()


def test_the_tier_figure_stacks_every_part_of_every_run(tmp_path):
    tiers = {"cpu": {"device": 0.0, "host: adam_states": 16.0, "disk": 0.0},
             "nvme": {"device": 0.0, "host: adam_states": 0.0, "disk": 27.0}}
    fig = memory_tiers(tiers, save_dir=tmp_path)
    heights = [[bar.get_height() for bar in c] for c in fig.axes[0].containers]
    assert heights == [[0.0, 0.0], [16.0, 0.0], [0.0, 27.0]]
    assert (tmp_path / "figures" / "zero_infinity_tiers.png").is_file()
