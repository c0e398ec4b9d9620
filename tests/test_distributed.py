"""Data rank on a device mesh (r_replicate * |dp_shard| + r_shard): only data-parallel peers read different rows."""

from torch.distributed.device_mesh import init_device_mesh

from gloo import run_on_ranks
from mmrecipes.distributed import Ranks, mesh_data_rank_and_world

MESHES = [("dp_replicate", "dp_shard"), ("dp_shard", "tp"), ("dp_replicate", "tp")]


def _data_ranks(rank, world_size):
    return [mesh_data_rank_and_world(init_device_mesh("cpu", (2, 2), mesh_dim_names=names)) for names in MESHES]


def test_data_rank_on_meshes():
    per_rank = run_on_ranks(_data_ranks, 4)
    hsdp, dp_shard_tp, dp_replicate_tp = zip(*per_rank)
    # HSDP: r_replicate * |dp_shard| + r_shard: all four ranks read different rows.
    assert hsdp == ((0, 4), (1, 4), (2, 4), (3, 4))
    # Tensor-parallel peers (ranks 2k, 2k+1 share a tp group) must read the same rows.
    assert dp_shard_tp == dp_replicate_tp == ((0, 2), (0, 2), (1, 2), (1, 2))


def test_teams_read_as_one_rank_and_their_first_member_counts():
    """GRPO's prompt reader: 4 data ranks in teams of 2 read as 2 (a team's index its data rank), each team's first
    member counting, and a sequence-parallel peer (counts_reads False) counts in no team."""
    ranks = [Ranks(data_rank=rank, data_world=4) for rank in range(4)]
    teams = [rank.teams(2) for rank in ranks]
    assert [team.reads() for team in teams] == [{"data_rank": 0, "data_world": 2}] * 2 + [
        {"data_rank": 1, "data_world": 2}] * 2
    assert [team.counts_reads for team in teams] == [True, False, True, False]
    assert not Ranks(data_rank=0, data_world=4, counts_reads=False).teams(2).counts_reads
    assert ranks[1].teams(1) == ranks[1]
