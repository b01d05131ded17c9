"""Two "nodes" on localhost (tests/nodes.py), one launcher invocation per node: torchrun's --nnodes/--node_rank
form at ZeRO 2 with 1 rank per node (node 1's one rank is global rank 1, local rank 0) and DeepSpeed's
launcher (--hostfile, --no_ssh, --node_rank) at ZeRO 3 with 2 ranks per node (global ranks 2-3 on node 1),
training on a text file. The 2-node run must equal the 1-node run with the same world size, its ranks must
agree on one model, and it must save and resume exactly (resume run at ZeRO 3, the launcher and stage that
partition most, to keep CI within its budget; tests/test_resume.py resumes every stage on one node)."""
import pytest

from helpers import REPO_ROOT, presets
from helpers.launch import run_program
from tests.nodes import hostfile_text, node_commands, run_on_nodes

STAGES = {2: ("torchrun", 1), 3: ("deepspeed", 2)}   # stage: launcher, ranks per node (4-rank runs on 2 cores are slow)


def options(stage: int, data, **more) -> dict:
    return dict(config=presets.CONFIG_DIR / f"zero{stage}.json", data=data, seq_len=32, steps=4, **more)


# Sample text: the page with the multi-node commands, then the front page and three more pages, one after another
# (up to 4 ranks x micro-batch 16 x 32 tokens is more text than one page holds).
PAGES = [REPO_ROOT / page for page in ("helpers/programs/README.md", "README.md", "notebooks/README.md",
                                       "notebooks/troubleshooting.md", "benchmarks/README.md")]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "mine.txt"
    path.write_text("\n".join(p.read_text() for p in PAGES))
    return path


@pytest.fixture(scope="module", params=sorted(STAGES))
def runs(request, text, tmp_path_factory):
    stage, (launcher, per_node) = request.param, STAGES[request.param]
    out = tmp_path_factory.mktemp(f"zero{stage}")
    two_nodes = run_on_nodes("train", 2, per_node, out_dir=out / "two_nodes", launcher=launcher,
                             **options(stage, text, save_every=2))
    one_node = run_program("train", 2 * per_node, out_dir=out / "one_node", **options(stage, text))
    resumed = None if stage != 3 else run_on_nodes(
        "train", 2, per_node, out_dir=out / "resumed", launcher=launcher,
        **options(stage, text, resume_from=out / "two_nodes" / "checkpoints" / "step2"))
    return stage, two_nodes, one_node, resumed


def losses(ranks: list[dict]) -> list[list[float]]:
    return [[m["loss"] for m in r["history"]] for r in ranks]


def test_two_nodes_give_the_one_node_run_of_the_same_world_size(runs):
    stage, two_nodes, one_node, _ = runs
    world = len(one_node)
    assert [(r["rank"], r["world_size"], r["steps"]) for r in two_nodes] == [(r, world, 4) for r in range(world)]
    flat = [[loss for rank in losses(run) for loss in rank] for run in (two_nodes, one_node)]
    assert flat[0] == pytest.approx(flat[1], rel=1e-6, abs=0)   # rank by rank, step by step
    print(f"ZeRO {stage}: 2 nodes x 2 ranks {losses(two_nodes)[0]}, 1 node x 4 ranks {losses(one_node)[0]}")


def test_the_ranks_of_both_nodes_train_one_model(runs):
    _, two_nodes, _, _ = runs
    assert len({r["eval_loss"] for r in two_nodes}) == 1            # the same weights, whichever node asks
    assert len({r["history"][0]["loss"] for r in two_nodes}) == len(two_nodes)   # but each rank its own shard of the batch


def test_a_two_node_checkpoint_resumes_exactly(runs):
    stage, two_nodes, _, resumed = runs
    if resumed is None:
        pytest.skip(f"resume is run at ZeRO 3 only; ZeRO {stage}'s two-node run is compared above")
    assert [r["steps"] for r in resumed] == [4] * 4
    assert [rank[2:] for rank in losses(resumed)] == [rank[2:] for rank in losses(two_nodes)]   # steps 3-4, trained again
    assert [r["eval_loss"] for r in resumed] == [r["eval_loss"] for r in two_nodes]


def test_node_commands_are_the_cluster_commands_with_a_local_master():
    torchrun = node_commands("m", ["--x"], nodes=2, ranks_per_node=8, port=29500)
    assert [c[c.index("--node_rank") + 1] for c in torchrun] == ["0", "1"]
    assert all(c[c.index("--master_addr") + 1] == "127.0.0.1" and "--nnodes" in c for c in torchrun)
    deepspeed = node_commands("m", [], nodes=2, ranks_per_node=8, port=29500, launcher="deepspeed", hostfile="h")
    assert all("--no_ssh" in c and c[c.index("--num_nodes") + 1] == "2" for c in deepspeed)
    assert hostfile_text(2, 8) == "node0 slots=8\nnode1 slots=8\n"
    with pytest.raises(ValueError, match="launcher must be"):
        node_commands("m", [], nodes=2, ranks_per_node=1, port=1, launcher="mpirun")
