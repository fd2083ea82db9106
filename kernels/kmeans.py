"""K-means over keys, batched (LouisKV's input units: a message's keys clustered per layer and KV head, each cluster
read back as one retrieval unit whose centroid is the mean of its keys).

The metric is squared Euclidean distance: a centroid is then the mean of its members, so a query's dot product with
it is exactly the mean of its dot products with the cluster's keys (what retrieval ranks units by), and keys close
in distance give a query close scores. Initialization is deterministic: k keys evenly spaced in the sequence
(neighbouring tokens' keys are alike, so this starts near a partition into runs). Each iteration assigns every
key to its nearest centroid (ties: the lower centroid) and moves each centroid to the mean of its keys; a centroid
that lost every key stays where it was, with a count of 0. The assignment returned is the one the returned means
were computed from, so every counted centroid is exactly its members' mean.

The assignment is the heavy part: B x n x k x D products, whose [B, n, k] distance matrix (1 GiB in float32 for
the 8B shape's 256 heads x 4,096 keys x 256 clusters) the Triton kernel never materializes: each program takes a
block of keys of one batch row and walks the centroids in tiles, keeping each key's best so far. On the GPU its
products are TF32 (a key nearly equidistant from two centroids may join either); the reference's are float32.
The means are torch's `index_add_` (memory-bound, n x D per row). `kmeans_ref` is the plain-torch definition.

Shapes: B batch rows (layers x KV heads), n keys each, D head size (up to 256), k clusters (1 <= k <= n).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.kernels._triton import INTERPRET, MAX_HEAD_DIM, SUPPORTED_DTYPES, next_power_of_2, triton, \
    triton_kernel_runs_on

if triton is not None:
    import triton.language as tl

DEFAULT_ITERATIONS = 8


def initial_centroids(x: Tensor, k: int) -> Tensor:
    """k keys of each row, evenly spaced: x [B, n, D] -> [B, k, D] float32 (key floor((i + 0.5) n / k) for i < k)."""
    n = x.shape[1]
    picks = ((torch.arange(k, device=x.device, dtype=torch.float64) + 0.5) * n / k).floor().long()
    return x[:, picks].float()


def nearest_centroid_ref(x: Tensor, centroids: Tensor) -> Tensor:
    """x [B, n, D], centroids [B, k, D] -> [B, n] int64: each key's nearest centroid (squared Euclidean distance,
    float32; ties to the lower centroid)."""
    xf = x.float()
    distance = (centroids * centroids).sum(-1)[:, None, :] - 2 * xf @ centroids.transpose(1, 2)  # + |x|^2, constant
    return distance.argmin(-1)


def centroid_means(x: Tensor, assign: Tensor, previous: Tensor) -> tuple[Tensor, Tensor]:
    """Each centroid moved to the mean of the keys assigned to it ([B, k, D] float32) and the counts [B, k] int64;
    a centroid without keys keeps its `previous` place."""
    b, n, d = x.shape
    k = previous.shape[1]
    flat = (assign + torch.arange(b, device=x.device)[:, None] * k).flatten()
    sums = torch.zeros(b * k, d, device=x.device, dtype=torch.float32).index_add_(0, flat, x.reshape(b * n, d).float())
    counts = torch.bincount(flat, minlength=b * k).view(b, k)
    means = sums.view(b, k, d) / counts.clamp_min(1)[..., None]
    return torch.where(counts[..., None] > 0, means, previous), counts


def kmeans_ref(x: Tensor, k: int, iterations: int = DEFAULT_ITERATIONS) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, n, D] -> (centroids [B, k, D] float32, assignment [B, n] int64, counts [B, k] int64): `iterations`
    rounds of assignment and update from `initial_centroids`."""
    return _lloyd(x, k, iterations, nearest_centroid_ref)


def _lloyd(x: Tensor, k: int, iterations: int, nearest) -> tuple[Tensor, Tensor, Tensor]:
    """`iterations` rounds of assignment (`nearest`) and update from `initial_centroids`."""
    _check(x, k, iterations)
    centroids = initial_centroids(x, k)
    for _ in range(iterations):
        assign = nearest(x, centroids)
        centroids, counts = centroid_means(x, assign, centroids)
    return centroids, assign, counts


if triton is not None:

    @triton.jit
    def _nearest_kernel(x_ptr, c_ptr, c_norm_ptr, out_ptr, n, k, stride_xb, stride_xn, stride_xd, stride_cb,
                        stride_ck, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """One block of BLOCK_N keys of batch row program_id(1): their nearest centroid, over tiles of BLOCK_K."""
        block, row = tl.program_id(0), tl.program_id(1)
        keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * stride_xb + keys[:, None] * stride_xn + dims[None, :] * stride_xd,
                    mask=(keys[:, None] < n) & (dims[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        best = tl.full([BLOCK_N], float("inf"), tl.float32)
        best_index = tl.zeros([BLOCK_N], tl.int64)
        for start in range(0, k, BLOCK_K):
            cs = start + tl.arange(0, BLOCK_K)
            c = tl.load(c_ptr + row * stride_cb + cs[:, None] * stride_ck + dims[None, :],
                        mask=(cs[:, None] < k) & (dims[None, :] < HEAD_DIM), other=0.0)
            norm = tl.load(c_norm_ptr + row * k + cs, mask=cs < k, other=float("inf"))
            # TF32 tensor-core products on the GPU (IEEE float32 in the interpreter): a near-tie may go to the other
            # centroid, which changes nothing a cluster is for; in IEEE float32 the kernel ran at 54 ms where torch's
            # materialized [B, n, k] product took 46 (8B shape, 4k keys, H100, 2026-11-27)
            distance = norm[None, :] - 2.0 * tl.dot(x, tl.trans(c), input_precision=PRECISION)
            tile_best = tl.min(distance, axis=1)
            tile_index = tl.argmin(distance, axis=1, tie_break_left=True).to(tl.int64) + start
            better = tile_best < best  # strictly: a tie keeps the earlier tile's (lower) centroid
            best_index = tl.where(better, tile_index, best_index)
            best = tl.where(better, tile_best, best)
        tl.store(out_ptr + row * n + keys, best_index, mask=keys < n)


def _nearest_triton(x: Tensor, centroids: Tensor) -> Tensor:
    b, n, d = x.shape
    k = centroids.shape[1]
    centroids = centroids.contiguous()
    norms = (centroids * centroids).sum(-1).contiguous()
    out = torch.empty(b, n, device=x.device, dtype=torch.int64)
    block_n = 32 if INTERPRET else 64
    block_k = 16 if INTERPRET else (64 if d <= 128 else 32)
    _nearest_kernel[(triton.cdiv(n, block_n), b)](
        x, centroids, norms, out, n, k, x.stride(0), x.stride(1), x.stride(2), centroids.stride(0),
        centroids.stride(1), HEAD_DIM=d, BLOCK_D=max(16, next_power_of_2(d)), BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if INTERPRET else "tf32")
    return out


def nearest_centroid(x: Tensor, centroids: Tensor) -> Tensor:
    """`nearest_centroid_ref`'s meaning, through the Triton kernel where `triton_kernel_runs_on(x.device)`."""
    if not triton_kernel_runs_on(x.device):
        return nearest_centroid_ref(x, centroids)
    return _nearest_triton(x, centroids)


def kmeans(x: Tensor, k: int, iterations: int = DEFAULT_ITERATIONS) -> tuple[Tensor, Tensor, Tensor]:
    """`kmeans_ref`'s meaning (x [B, n, D] in float32, float16 or bfloat16, any strides), each assignment through the
    Triton kernel where `triton_kernel_runs_on(x.device)`."""
    return _lloyd(x, k, iterations, nearest_centroid)


def _check(x: Tensor, k: int, iterations: int) -> None:
    if x.dim() != 3 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"keys are [B, n, D] in float32, float16 or bfloat16, not {tuple(x.shape)} {x.dtype}")
    if not 1 <= k <= x.shape[1]:
        raise ValueError(f"k-means needs 1 <= k <= n keys, not k={k} for n={x.shape[1]}")
    if x.shape[2] > MAX_HEAD_DIM or iterations < 1:
        raise ValueError(f"head size at most {MAX_HEAD_DIM} and at least one iteration")


def benchmark(batch: int = 256, n: int = 4096, k: int = 256, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
              device: str = "cuda") -> dict:
    """Milliseconds of `kmeans` and `kmeans_ref` on random keys shaped like one 4k-token message of the 8B shape
    (32 layers x 8 KV heads), 16 keys a cluster."""
    from triton.testing import do_bench

    x = torch.randn(batch, n, head_dim, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(0))
    return dict(batch=batch, n=n, k=k, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                kernel_ms=do_bench(lambda: kmeans(x, k)), reference_ms=do_bench(lambda: kmeans_ref(x, k)))
