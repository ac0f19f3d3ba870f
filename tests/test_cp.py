"""Context parallelism: megatron-core's load-balanced sequence split and the CP loss, on 4 real gloo ranks.

Four processes (torch.multiprocessing.spawn) start through the runtime's own init_distributed and
megatron's initialize_model_parallel with context_parallel_size=2, so DP = 2: ranks {0, 1} and {2, 3}
are the CP groups, each DP rank reads its own micro-batch. Each rank must keep chunks i and
2·CP−1−i of *its* DP rank's sequence (megatron's zigzag over the CP group; megatron-core 0.19 reads a
missing group as the world and split it into 2·4 chunks), and the CP loss must give every rank the
full-sequence mean while the ranks' gradients average to the DP mean of the full-sequence gradients.
"""

from __future__ import annotations

import os

import pytest
import torch

from orchestrator.runtime.rank.distributed import reserve_local_port

pytestmark = [pytest.mark.slow, pytest.mark.mcore_lines]  # four processes importing megatron-core

CP, DP, B, S = 2, 2, 2, 8  # 2·CP = 4 chunks of 2 tokens
WORLD = CP * DP


def _full_batch(dp_rank: int) -> dict:
    tokens = torch.arange(B * S, dtype=torch.int64).reshape(B, S) + 100 * dp_rank
    return {
        "tokens": tokens,
        "labels": tokens + 1000,
        "position_ids": torch.arange(S).repeat(B, 1),
        "loss_mask": torch.tensor([[1.0] * S, [1.0] * (S - 3) + [0.0] * 3]),
        "attention_mask": None,
    }


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from megatron.core import parallel_state as ps

    from orchestrator.config.schema import JobConfig
    from orchestrator.runtime.rank import cp
    from orchestrator.runtime.rank.distributed import init_distributed, shutdown

    cfg = JobConfig()
    cfg.training.device = "cpu"
    info = init_distributed(cfg)
    ps.initialize_model_parallel(context_parallel_size=CP)
    try:
        dp_rank, cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
        assert cp.cp_size() == CP and (dp_rank, cp_rank) == divmod(info.rank, CP)
        part = cp.batch_on_this_cp_rank(_full_batch(dp_rank))
        # Loss: per-token "losses" w * x with one weight; the ranks' gradients must sum to the full mean's.
        w = torch.tensor(0.5, requires_grad=True)
        x = part["labels"].float()
        loss, report = cp.loss_func(part["loss_mask"], w * x)
        (loss * CP).backward()  # megatron's schedule scales a 2-tuple loss by the CP size
        grad = w.grad.detach().reshape(1)
        torch.distributed.all_reduce(grad, group=cp.loss_group())
        grad /= torch.distributed.get_world_size(cp.loss_group())  # DDP averages over DP x CP
        torch.save(
            {
                "part": part,
                "report": report["lm loss"],
                "grad": grad,
                "hosts": info.hosts,
                "dp": dp_rank,
                "cp": cp_rank,
                "cp_group": torch.distributed.get_process_group_ranks(ps.get_context_parallel_group()),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    torch.multiprocessing.spawn(_rank_main, args=(reserve_local_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_each_cp_rank_keeps_chunks_i_and_2cp_minus_1_minus_i(ranks):
    """Against a hand split: CP rank r of DP rank d keeps positions [2r, 2r+1, 6-2r, 7-2r] of batch d."""
    chunk = S // (2 * CP)
    assert [(got["dp"], got["cp"], got["cp_group"]) for got in ranks] == [
        (0, 0, [0, 1]),
        (0, 1, [0, 1]),
        (1, 0, [2, 3]),
        (1, 1, [2, 3]),
    ]
    for got in ranks:
        full, r = _full_batch(got["dp"]), got["cp"]
        keep = [*range(r * chunk, (r + 1) * chunk), *range((2 * CP - 1 - r) * chunk, (2 * CP - r) * chunk)]
        for key in ("tokens", "labels", "position_ids", "loss_mask"):
            assert got["part"][key].shape == (B, S // CP)
            assert torch.equal(got["part"][key], full[key][:, keep]), (got["dp"], r, key)
        assert got["part"]["attention_mask"] is None
    # CP rank 0: positions 0,1,6,7; CP rank 1: positions 2,3,4,5 — together the whole sequence, once.
    for dp in range(DP):
        assert ranks[dp * CP]["part"]["position_ids"][0].tolist() == [0, 1, 6, 7]
        assert ranks[dp * CP + 1]["part"]["position_ids"][0].tolist() == [2, 3, 4, 5]
        assert ranks[dp * CP + 1]["part"]["tokens"][0].tolist() == [100 * dp + t for t in (2, 3, 4, 5)]


def test_cp_loss_is_the_full_sequence_mean_and_its_gradient(ranks):
    w = torch.tensor(0.5, requires_grad=True)
    means = []
    for dp in range(DP):
        full = _full_batch(dp)
        x, mask = full["labels"].float(), full["loss_mask"]
        means.append(torch.sum(w * x * mask) / mask.sum())
    (sum(means) / DP).backward()  # DDP's average over the DP replicas of each one's full-sequence mean
    for got in ranks:
        assert torch.allclose(got["report"], means[got["dp"]].detach(), rtol=1e-6)
        assert torch.allclose(got["grad"], w.grad.reshape(1), rtol=1e-6)
    assert all(got["hosts"] == ranks[0]["hosts"] for got in ranks) and len(ranks[0]["hosts"]) == WORLD
