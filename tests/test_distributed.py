"""Data rank on a device mesh (r_replicate * |dp_shard| + r_shard): only data-parallel peers read different rows."""

from torch.distributed.device_mesh import init_device_mesh

from gloo import run_on_ranks
from mmrecipes.distributed import mesh_data_rank_and_world

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
