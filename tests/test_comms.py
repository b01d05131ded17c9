"""Communication volume: ring send factors and the ZeRO paper's per-stage prediction."""
import pytest

from helpers.comms import predicted_units, sent_bytes


def test_all_reduce_sends_twice_the_tensor_times_n_minus_1_over_n():
    assert sent_bytes({"all_reduce": {1000: 3}}, 4)["all_reduce"] == pytest.approx(3 * 2 * 1000 * 3 / 4)


def test_zero2_as_in_the_paper_equals_data_parallel():
    psi_bytes, n = 4_000, 2
    data_parallel = sent_bytes({"all_reduce": {psi_bytes: 1}}, n)
    # reduce-scatter the gradients (whole tensor logged), all-gather the updated shard (shard logged)
    zero2 = sent_bytes({"reduce_scatter_tensor": {psi_bytes: 1}, "all_gather_into_tensor": {psi_bytes // n: 1}}, n)
    assert sum(zero2.values()) == pytest.approx(data_parallel["all_reduce"])
    # the paper's units are Ψ·bytes·(N-1)/N: here Ψ = 1,000 fp32 elements
    assert data_parallel["all_reduce"] == pytest.approx(predicted_units(0, 1) * psi_bytes * (n - 1) / n)


def test_zero3_is_one_and_a_half_times_data_parallel():
    assert predicted_units(3, accum=1) / predicted_units(0, accum=1) == pytest.approx(1.5)


def test_single_rank_sends_nothing_and_unknown_ops_are_refused():
    assert sent_bytes({"all_reduce": {100: 1}}, 1) == {"all_reduce": 0.0}
    with pytest.raises(ValueError, match="all_to_all"):
        sent_bytes({"all_to_all": {100: 1}}, 2)


def test_predicted_units_reduce_to_the_paper_at_one_micro_batch():
    assert [predicted_units(s, accum=1) for s in range(4)] == [2, 2, 2, 3]
    assert [predicted_units(s, accum=2, algorithm="deepspeed") for s in range(4)] == [2, 3, 5, 4]
    with pytest.raises(ValueError, match="stage=7"):
        predicted_units(7, 1)


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_gloo_sends_what_its_factors_say_by_the_kernels_count(tmp_path, n_ranks):
    """GLOO_SEND_FACTOR against an independent count: the bytes each rank's process wrote to its sockets
    (/proc/self/io) per byte the comms logger would record, on real gloo ranks."""
    from helpers.comms import GLOO_SEND_FACTOR, SEND_FACTOR, written_bytes
    from helpers.launch import launch
    if written_bytes() is None:
        pytest.skip("no /proc/self/io on this system")
    ranks = launch("tests.rank_programs.wire_bytes", n_ranks, out_dir=tmp_path, timeout=120)
    for rank in ranks:
        for op, measured in rank["per_logged_byte"].items():
            assert measured == pytest.approx(GLOO_SEND_FACTOR[op](n_ranks), rel=0.01), (rank["rank"], op, measured)
    # where gloo is not the ring: its reduce-scatter writes twice the ring's bytes
    ring = SEND_FACTOR["reduce_scatter_tensor"](n_ranks)
    assert ranks[0]["per_logged_byte"]["reduce_scatter_tensor"] == pytest.approx(2 * ring, rel=0.01)
