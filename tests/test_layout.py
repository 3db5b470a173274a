import sys

import pytest

from hpcps.core.layout import check_num_ps, place_ps, spread_ps


def test_layout_imports_no_mpi():
    import hpcps.core.layout  # noqa: F401
    import hpcps.core.sharding  # noqa: F401
    # pure modules must be importable without initialising MPI
    assert "hpcps.core.layout" in sys.modules


@pytest.mark.parametrize("bad", [0, -1, 4, 5])
def test_impossible_num_ps(bad):
    with pytest.raises(ValueError, match="num_ps"):
        check_num_ps(bad, 4)


def test_world_of_one_names_the_launch_problem():
    with pytest.raises(ValueError, match="world of 1 rank.*mpiexec"):
        check_num_ps(1, 1)


@pytest.mark.parametrize("bad", [1.5, "two", None, True])
def test_num_ps_must_be_integer(bad):
    with pytest.raises(ValueError, match="integer"):
        check_num_ps(bad, 4)


def test_num_ps_from_string():
    assert check_num_ps("2", 4) == 2


def test_single_node_takes_highest_ranks():
    assert spread_ps([0, 0, 0, 0], 1) == [3]
    assert spread_ps([0, 0, 0, 0], 2) == [2, 3]


def test_spread_over_nodes_round_robin():
    nodes = ["a"] * 4 + ["b"] * 4
    assert spread_ps(nodes, 2) == [3, 7]             # one per node, not both on node a
    assert spread_ps(nodes, 3) == [2, 3, 7]
    assert spread_ps(nodes, 4) == [2, 3, 6, 7]


def test_uneven_nodes_skip_exhausted():
    nodes = ["a", "b", "b", "b", "b"]
    ps = spread_ps(nodes, 3)
    assert ps == [0, 3, 4]
    assert 1 in set(range(5)) - set(ps)              # a worker remains


def test_rank_zero_stays_worker_when_possible():
    assert 0 not in spread_ps([0] * 6, 5)


@pytest.mark.parametrize("env", [{"SLURM_STEP_NUM_TASKS": "4"}, {"PMI_SIZE": "4"}, {"OMPI_COMM_WORLD_SIZE": "3"},
                                 {"HPCPS_WORLD_SIZE": "2"}])
def test_a_launch_larger_than_the_world_fails_loudly(env):
    from hpcps.core.layout import check_launch
    with pytest.raises(ValueError, match="MPI world (has|of) 1"):
        check_launch(1, env)


def test_a_world_size_set_by_key_is_named_so():
    from hpcps.core.layout import check_launch
    with pytest.raises(ValueError, match="^job.world_size=5 but the MPI world has 4 ranks"):
        check_launch(4, {}, 5)


def test_launch_checks_pass_for_a_whole_world():
    from hpcps.core.layout import check_launch
    check_launch(4, {"SLURM_STEP_NUM_TASKS": "4", "PMI_SIZE": "4", "HPCPS_WORLD_SIZE": "4"})
    check_launch(4, {"SLURM_STEP_NUM_TASKS": "1"})      # mpiexec in an allocation: one proxy per node
    check_launch(1, {})


def test_ps_layout_last_takes_the_highest_ranks_and_names_bad_layouts():
    nodes = [0, 0, 1, 1, 2]
    assert place_ps(nodes, 2, "last") == [3, 4]
    assert place_ps(nodes, 2, "spread") == spread_ps(nodes, 2) == [1, 3]
    with pytest.raises(ValueError, match="ps_layout must be one of"):
        place_ps(nodes, 1, "first")


def test_the_layout_line_names_hosts_ps_and_how_each_worker_reads():
    from hpcps.train.layout import layout_line     # pure: the gathering is not called here
    line = layout_line({"hosts": 2, "host_names": ["a", "b"], "ranks_per_host": [3, 1], "ps_per_host": [1, 1],
                        "dense": "mpi", "workers": [{"shm_ps": [0], "rma_ps": [1]}, {"shm_ps": [0], "rma_ps": [1]}]})
    assert line == ("2 hosts (a: 3 ranks, 1 PS; b: 1 rank, 1 PS); workers 0,1: PS 0 by shared memory, "
                    "PS 1 over RMA; dense all-reduce: mpi")


def test_the_layout_line_says_a_dynamic_table_reaches_other_hosts_by_messages():
    from hpcps.train.layout import layout_line
    line = layout_line({"hosts": 2, "host_names": ["a", "b"], "ranks_per_host": [2, 2], "ps_per_host": [1, 1],
                        "dense": "mpi", "remote": "messages",
                        "workers": [{"shm_ps": [0], "rma_ps": [1]}, {"shm_ps": [1], "rma_ps": [0]}]})
    assert line == ("2 hosts (a: 2 ranks, 1 PS; b: 2 ranks, 1 PS); worker 0: PS 0 by shared memory, "
                    "PS 1 by messages; worker 1: PS 1 by shared memory, PS 0 by messages; dense all-reduce: mpi")


def test_the_layout_line_leaves_out_a_way_no_ps_is_reached():
    """Issue 51.18: "PS - over RMA" (one host: no PS over RMA) was unexplained."""
    from hpcps.train.layout import layout_line
    line = layout_line({"hosts": 1, "host_names": ["a"], "ranks_per_host": [3], "ps_per_host": [1],
                        "dense": "shm", "workers": [{"shm_ps": [0], "rma_ps": []}, {"shm_ps": [0], "rma_ps": []}]})
    assert line == "1 host (a: 3 ranks, 1 PS); workers 0,1: PS 0 by shared memory; dense all-reduce: shm"


def test_standbys_spread_over_nodes_from_the_last_and_never_take_rank_0():
    from hpcps.core.layout import place_standby
    assert place_standby([0, 0, 0, 0, 0, 0], 2) == [4, 5]
    assert place_standby([0, 0, 0, 3, 3, 3], 2) == [2, 5]        # one on each host: a lost host takes one
    assert place_standby([0, 0, 2, 2, 4, 4], 1) == [5]
    assert place_standby([0, 0, 0, 0], 0) == []


@pytest.mark.parametrize("bad, want", [(-1, "integer >= 0"), (1.5, "integer >= 0"), (True, "integer >= 0"),
                                       (3, "leaves 2 of the 5 ranks to train, fewer than job.num_ps = 2 PS")])
def test_impossible_standby_counts_are_named(bad, want):
    from hpcps.core.layout import check_standby
    with pytest.raises(ValueError, match=want.replace(".", r"\.")):
        check_standby(bad, 2, 5)
    assert check_standby(2, 2, 5) == 2
