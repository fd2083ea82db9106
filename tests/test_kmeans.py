"""K-means over keys (kernels/kmeans.py, LouisKV's input units): the assignment kernel against `nearest_centroid_ref`,
the whole clustering against `kmeans_ref`, and what the reference itself guarantees.

As for the other kernels: the `test_interpreted_*` tests run in a child pytest with TRITON_INTERPRET=1
(`test_the_kernel_in_triton_s_interpreter`), the GPU tests (`gpu` marker) on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import passed_in_interpreter

from kvchat.kernels import kmeans as kmeans_module
from kvchat.kernels.kmeans import (
    centroid_means,
    initial_centroids,
    kmeans,
    kmeans_ref,
    nearest_centroid,
    nearest_centroid_ref,
)

interpreted = pytest.mark.skipif(not kmeans_module.INTERPRET,
                                 reason="run by test_the_kernel_in_triton_s_interpreter with TRITON_INTERPRET=1")

# (B rows, n keys, k centroids, D, dtype). Under the interpreter the kernel's tiles are 32 keys x 16 centroids:
# n = 45 and k = 37 end inside a tile, D = 80 is not a power of two.
INTERPRETER_CASES = [
    (1, 1, 1, 64, torch.float32),
    (3, 45, 37, 64, torch.float32),
    (2, 100, 7, 80, torch.float32),
    (2, 64, 16, 128, torch.float16),
    (4, 70, 5, 64, torch.bfloat16),
]
GPU_CASES = [(b, n, k, d, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)
             for b, n, k, d in ((1, 17, 3, 64), (256, 4096, 256, 128), (16, 1000, 63, 256), (8, 300, 300, 128))]


def case_id(case) -> str:
    b, n, k, d, dtype = case
    return f"B{b}-n{n}-k{k}-D{d}-{str(dtype).removeprefix('torch.')}"


# How far a chosen centroid's distance may exceed the least, relative to |x|^2 + |c|^2: float32 sums in the
# interpreter; on CUDA the kernel's products run on tensor cores in TF32 (10-bit mantissas: ~1e-3 of each product).
TOLERANCE = {"cpu": 1e-5, "cuda": 4e-3}


def random_keys(b: int, n: int, d: int, dtype, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(b, n, d, generator=gen, device=device).to(dtype)


def planted_blobs(b: int, clusters: int, per: int, d: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Keys in `clusters` tight, far-apart blobs of `per` keys, consecutive in the sequence (as a message's runs of
    related tokens); (keys [b, clusters * per, d], each key's blob [clusters * per])."""
    gen = torch.Generator(device=device).manual_seed(1)
    centres = 20 * torch.randn(b, clusters, 1, d, generator=gen, device=device)
    keys = centres + 0.1 * torch.randn(b, clusters, per, d, generator=gen, device=device)
    return keys.reshape(b, clusters * per, d), torch.arange(clusters, device=device).repeat_interleave(per)


def check_nearest(x: torch.Tensor, centroids: torch.Tensor, got: torch.Tensor) -> None:
    """Each key's chosen centroid is a nearest one: its distance equals the least up to float32's rounding of the
    products (a near-tie may go either way between two summation orders), and nearly every choice is the ref's."""
    want = nearest_centroid_ref(x, centroids)
    xd, cd = x.double(), centroids.double()
    # |x - c|^2 in float64 ([B, n, k]: 2 GiB at the largest case, where [B, n, k, D] differences would be 128)
    distance = (xd * xd).sum(-1)[..., None] + (cd * cd).sum(-1)[:, None, :] - 2 * xd @ cd.transpose(1, 2)
    chosen = distance.gather(2, got[..., None])[..., 0]
    least = distance.min(-1).values
    scale = (xd * xd).sum(-1) + (cd * cd).sum(-1).max(-1).values[:, None]
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert ((chosen - least) <= TOLERANCE[x.device.type] * scale + 1e-6).all()
    assert (got == want).float().mean() >= 0.99


# --- the kernel, in triton's interpreter (a child process) or on CUDA ---

@interpreted
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=case_id)
def test_interpreted_nearest_centroid_matches_the_reference(case):
    b, n, k, d, dtype = case
    x = random_keys(b, n, d, dtype, "cpu")
    centroids = initial_centroids(x, k) + 0.01 * torch.randn(b, k, d, generator=torch.Generator().manual_seed(2))
    check_nearest(x, centroids, nearest_centroid(x, centroids))


@interpreted
def test_interpreted_kmeans_finds_the_planted_clusters_as_the_reference():
    x, _ = planted_blobs(2, 5, 9, 64)
    got, want = kmeans(x, 5), kmeans_ref(x, 5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_the_kernel_in_triton_s_interpreter():
    if kmeans_module.INTERPRET:
        pytest.skip("already in the interpreter")
    assert passed_in_interpreter(__file__) == len(INTERPRETER_CASES) + 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_nearest_centroid_matches_the_reference(case):
    b, n, k, d, dtype = case
    x = random_keys(b, n, d, dtype, "cuda")
    centroids = initial_centroids(x, k) + 0.01 * torch.randn(b, k, d, device="cuda")
    check_nearest(x, centroids, nearest_centroid(x, centroids))


@pytest.mark.gpu
def test_gpu_kmeans_finds_the_planted_clusters():
    x, blob = planted_blobs(256, 64, 16, 128, device="cuda")
    centroids, assign, counts = kmeans(x.to(torch.bfloat16), 64)
    assert (counts == 16).all()
    for row in assign.cpu():  # the same partition as the blobs (cluster numbers may differ)
        assert torch.equal(row, row[blob.cpu() * 16]) and len(set(row.tolist())) == 64


# --- in this process: the reference and the input checks ---

def test_the_reference_recovers_planted_clusters_and_each_centroid_is_its_members_mean():
    x, blob = planted_blobs(3, 6, 8, 32)
    centroids, assign, counts = kmeans_ref(x, 6)
    assert (counts == 8).all()
    for r in range(3):
        groups = {tuple((assign[r] == c).nonzero().flatten().tolist()) for c in range(6)}
        assert groups == {tuple(range(i * 8, i * 8 + 8)) for i in range(6)}
        for c in range(6):
            torch.testing.assert_close(centroids[r, c], x[r, assign[r] == c].mean(0))


def test_each_iteration_lowers_the_within_cluster_distance_and_an_empty_centroid_stays():
    x = random_keys(2, 200, 16, torch.float32, "cpu", seed=3)
    objective = []
    for iterations in range(1, 7):
        centroids, assign, _ = kmeans_ref(x, 12, iterations)
        objective.append(((x - centroids.gather(1, assign[..., None].expand(-1, -1, 16))) ** 2).sum().item())
    assert all(b <= a + 1e-3 for a, b in zip(objective, objective[1:])) and objective[-1] < objective[0]
    previous = torch.zeros(1, 3, 2)
    moved, counts = centroid_means(torch.tensor([[[1.0, 1.0], [3.0, 3.0]]]), torch.tensor([[0, 0]]), previous)
    assert counts.tolist() == [[2, 0, 0]] and moved[0, 0].tolist() == [2.0, 2.0] and moved[0, 1:].abs().sum() == 0


def test_as_many_clusters_as_keys_gives_each_key_its_own():
    x = random_keys(2, 10, 8, torch.float32, "cpu")
    centroids, assign, counts = kmeans_ref(x, 10)
    assert (assign == torch.arange(10)).all() and (counts == 1).all() and torch.equal(centroids, x)


@pytest.mark.parametrize("shape, k, iterations", [((2, 10), 2, 1), ((1, 5, 8), 0, 1), ((1, 5, 8), 6, 1),
                                                  ((1, 5, 300), 2, 1), ((1, 5, 8), 2, 0)])
def test_bad_inputs_are_refused(shape, k, iterations):
    with pytest.raises(ValueError):
        kmeans(torch.zeros(shape), k, iterations)
