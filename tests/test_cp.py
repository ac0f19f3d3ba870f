"""Context parallelism: megatron-core's load-balanced sequence split and the CP loss, on 2 real gloo ranks.

Two processes (torch.multiprocessing.spawn) start through the runtime's own init_distributed and
megatron's initialize_model_parallel with context_parallel_size=2. Each must keep chunks i and
2·CP−1−i of the sequence (megatron's zigzag), and the CP loss must give every rank the
full-sequence mean while the ranks' gradients add up to the full-sequence gradient.
"""

from __future__ import annotations

import os

import pytest
import torch

from orchestrator.runtime.rank.distributed import reserve_local_port

pytestmark = pytest.mark.slow  # two processes importing megatron-core

CP, B, S = 2, 2, 8  # 2·CP = 4 chunks of 2 tokens


def _full_batch() -> dict:
    tokens = torch.arange(B * S, dtype=torch.int64).reshape(B, S)
    return {"tokens": tokens, "labels": tokens + 1000, "position_ids": torch.arange(S).repeat(B, 1),
            "loss_mask": torch.tensor([[1.0] * S, [1.0] * (S - 3) + [0.0] * 3]), "attention_mask": None}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(CP), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps

    from orchestrator.runtime.rank import cp
    from orchestrator.runtime.rank.distributed import init_distributed, shutdown
    from orchestrator.config.schema import JobConfig

    cfg = JobConfig()
    cfg.training.device = "cpu"
    info = init_distributed(cfg)
    ps.initialize_model_parallel(context_parallel_size=CP)
    try:
        assert cp.cp_size() == CP and ps.get_context_parallel_rank() == info.rank
        part = cp.batch_on_this_cp_rank(_full_batch())
        # Loss: per-token "losses" w * x with one weight; the ranks' gradients must sum to the full mean's.
        w = torch.tensor(0.5, requires_grad=True)
        x = part["labels"].float()
        loss, report = cp.loss_func(part["loss_mask"], w * x)
        (loss * CP).backward()  # megatron's schedule scales a 2-tuple loss by the CP size
        grad = w.grad.detach().reshape(1)
        torch.distributed.all_reduce(grad, group=cp.loss_group())
        grad /= torch.distributed.get_world_size(cp.loss_group())  # DDP averages over DP x CP
        torch.save({"part": part, "report": report["lm loss"], "grad": grad, "hosts": info.hosts},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    torch.multiprocessing.spawn(_rank_main, args=(reserve_local_port(), str(out)), nprocs=CP, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(CP)]


def test_each_cp_rank_keeps_chunks_i_and_2cp_minus_1_minus_i(ranks):
    full = _full_batch()
    chunk = S // (2 * CP)
    for r, got in enumerate(ranks):
        keep = [*range(r * chunk, (r + 1) * chunk), *range((2 * CP - 1 - r) * chunk, (2 * CP - r) * chunk)]
        for key in ("tokens", "labels", "position_ids", "loss_mask"):
            assert got["part"][key].shape == (B, S // CP)
            assert torch.equal(got["part"][key], full[key][:, keep]), (r, key)
        assert got["part"]["attention_mask"] is None
    # rank 0: positions 0,1,6,7; rank 1: positions 2,3,4,5 — together the whole sequence, once.
    assert ranks[0]["part"]["position_ids"][0].tolist() == [0, 1, 6, 7]
    assert ranks[1]["part"]["position_ids"][0].tolist() == [2, 3, 4, 5]


def test_cp_loss_is_the_full_sequence_mean_and_its_gradient(ranks):
    full = _full_batch()
    x, mask = full["labels"].float(), full["loss_mask"]
    w = torch.tensor(0.5, requires_grad=True)
    mean = torch.sum(w * x * mask) / mask.sum()
    mean.backward()
    for got in ranks:
        assert torch.allclose(got["report"], mean.detach(), rtol=1e-6)
        assert torch.allclose(got["grad"], w.grad.reshape(1), rtol=1e-6)
    assert ranks[0]["hosts"] == ranks[1]["hosts"] and len(ranks[0]["hosts"]) == CP
