"""Key bounds (engine.kv.key_bounds): per-block key minima and maxima that bound any query's score, and the per-round
attention share a recheck estimates from them."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.engine.kv.key_bounds import BLOCK, BoundsTable, block_counts, key_bounds, round_share_ref

LU, HKV, D, REP = 2, 2, 16, 3


def table_of(keys: torch.Tensor, lengths: list[int], dtype=torch.float32) -> BoundsTable:
    """keys [LU, HKV, S, D] of rounds of `lengths`, one after the other."""
    table = BoundsTable(LU, HKV, D, dtype, torch.device("cpu"))
    at = 0
    for n in lengths:
        table.append(n, key_bounds(keys[:, :, at : at + n].to(dtype)))
        at += n
    return table


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_bounds_are_each_blocks_minimum_and_maximum(n):
    keys = torch.randn(LU, HKV, n, D)
    got = key_bounds(keys)
    assert got.shape == (LU, 2, HKV, math.ceil(n / BLOCK), D)
    for b in range(got.shape[3]):
        block = keys[:, :, b * BLOCK : (b + 1) * BLOCK]
        assert torch.equal(got[:, 0, :, b], block.amin(2)) and torch.equal(got[:, 1, :, b], block.amax(2))
    assert block_counts(n).sum() == n and len(block_counts(n)) == got.shape[3]


def test_no_key_of_a_block_scores_above_its_bound():
    keys, q = torch.randn(LU, HKV, 100, D), torch.randn(HKV * REP, D)
    bounds = key_bounds(keys)[0]  # layer 0: [2, HKV, nb, D]
    lo, hi = bounds[0], bounds[1]
    qg = q.view(HKV, REP, D)
    bound = qg @ ((lo + hi) / 2).transpose(1, 2) + qg.abs() @ ((hi - lo) / 2).transpose(1, 2)  # [HKV, REP, nb]
    scores = qg @ keys[0].transpose(1, 2)  # [HKV, REP, 100]
    for b in range(bounds.shape[2]):
        assert (scores[:, :, b * BLOCK : (b + 1) * BLOCK].amax(-1) <= bound[:, :, b] + 1e-5).all()


def test_the_share_is_exact_when_each_block_holds_one_key_repeated():
    lengths = [40, 70, 33, 64]
    distinct = torch.randn(LU, HKV, sum(math.ceil(n / BLOCK) for n in lengths), D)
    keys, at = [], 0
    for n in lengths:  # every token of a block has its block's key: the bounds are the key itself
        nb = math.ceil(n / BLOCK)
        keys.append(distinct[:, :, at : at + nb].repeat_interleave(BLOCK, dim=2)[:, :, :n])
        at += nb
    keys = torch.cat(keys, dim=2)
    table, q = table_of(keys, lengths), torch.randn(HKV * REP, D)
    starts = [0, 40, 110, 143]
    for layer in range(LU):
        for skip in (True, False):
            want = round_share_ref(q, keys[layer], starts, skip_first=skip)
            assert torch.allclose(table.round_share(q, layer, skip_first=skip), want, atol=1e-5)
    assert table.round_share(q, 0)[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_round_holding_a_key_that_matches_the_query_gets_the_largest_share(dtype):
    torch.manual_seed(0)
    lengths = [50, 90, 120, 60]
    keys, q = 0.3 * torch.randn(LU, HKV, sum(lengths), D), torch.randn(HKV * REP, D)
    keys[:, :, 50 + 90 + 17] = 4 * q.view(HKV, REP, D).mean(1)  # one token of round 2 answers the query
    share = table_of(keys, lengths, dtype).round_share(q, 1)
    assert int(share.argmax()) == 2 and share[2] > 0.5 and abs(float(share.sum()) - 1) < 1e-5


def test_fill_truncate_and_round():
    keys = torch.randn(LU, HKV, 100, D)
    table = BoundsTable(LU, HKV, D, torch.float32, torch.device("cpu"))
    table.append(40, key_bounds(keys[:, :, :40]))
    table.append(60, None)
    assert table.round(1) is None and table.known == [True, False]
    table.fill(1, key_bounds(keys[:, :, 40:]))
    assert torch.equal(table.round(1), key_bounds(keys[:, :, 40:]))
    assert table.nbytes() == LU * 2 * HKV * (2 + 2) * D * 4
    table.truncate(1)
    assert table.n_rounds == 1 and table.bounds.shape[3] == 2 and torch.equal(table.round(0), key_bounds(keys[:, :, :40]))
    with pytest.raises(ValueError, match="key bounds of shape"):
        table.append(10, key_bounds(keys[:, :, :40]))


def test_all_layers_at_once_score_as_each_layer_alone():
    lengths = [40, 70, 33]
    keys, q = torch.randn(LU, HKV, sum(lengths), D), torch.randn(LU, HKV * REP, D)
    table = table_of(keys, lengths)
    together = table.round_shares(q)
    for layer in range(LU):
        assert torch.allclose(together[layer], table.round_share(q[layer], layer), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_bounds_on_the_gpu_score_as_float32_on_the_cpu():
    torch.manual_seed(1)
    lengths = [500, 900, 1200, 600]
    keys, q = torch.randn(LU, HKV, sum(lengths), D), torch.randn(LU, HKV * REP, D)
    keys[:, :, 500 + 900 + 17] = 4 * q.view(LU, HKV, REP, D).mean(2)
    want = table_of(keys, lengths).round_shares(q)
    table = BoundsTable(LU, HKV, D, torch.bfloat16, torch.device("cuda"))
    at = 0
    for n in lengths:
        table.append(n, key_bounds(keys[:, :, at : at + n].to("cuda", torch.bfloat16)))
        at += n
    got = table.round_shares(q.to("cuda", torch.bfloat16)).cpu()
    assert (got.argmax(1) == want.argmax(1)).all() and (got - want).abs().max() < 0.05


def test_the_table_grows_past_its_first_storage_keeping_every_round():
    lengths = [300] * 10  # 100 blocks: more than the table starts with
    keys = torch.randn(LU, HKV, sum(lengths), D)
    table = table_of(keys, lengths)
    assert table.bounds.shape[3] == 100
    for r in range(10):
        assert torch.equal(table.round(r), key_bounds(keys[:, :, 300 * r : 300 * (r + 1)]))
