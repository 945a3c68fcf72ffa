"""The kernels of scripts/gpu/persistent_probe.py (a module of their own: Triton is imported only on a GPU)."""
import triton
import triton.language as tl


@triton.jit
def _gemv_tiles(x_ptr, w_ptr, y_ptr, n_in, n_out, x_stride, y_stride, batch, first, step,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, VOLATILE: tl.constexpr):
    """y[:batch, tile] = x[:batch, :n_in] @ w[tile, :n_in]^T for tiles first, first + step, ..."""
    rows = tl.arange(0, ROWS)
    for tile in range(first, tl.cdiv(n_out, BLOCK_N), step):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x_mask = (rows[:, None] < batch) & (ks[None, :] < n_in)
            if VOLATILE:   # written by other programs of this kernel: read past L1
                x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=x_mask, other=0.0, volatile=True)
            else:
                x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=x_mask, other=0.0)
            w = tl.load(w_ptr + cols[:, None] * n_in + ks[None, :], mask=(cols[:, None] < n_out) & (ks[None, :] < n_in),
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
        tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < batch) & (cols[None, :] < n_out))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, n_in, n_out, x_stride, y_stride, batch,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    _gemv_tiles(x_ptr, w_ptr, y_ptr, n_in, n_out, x_stride, y_stride, batch, tl.program_id(0), tl.num_programs(0),
                BLOCK_N, BLOCK_K, ROWS, False)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program adds one and waits until all have (target = programs x barriers so far). The
    block barriers around it make the program's stores happen before its release, and its acquire
    before any of its threads reads on."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _step_kernel(x_ptr, w0, w1, w2, w3, y0, y1, y2, counter_ptr, batch, layers,
                 H: tl.constexpr, I: tl.constexpr, WORK: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """A decode step's projections in one launch: per layer QKV, o_proj, gate/up, down, a grid
    barrier after each (WORK False: the barriers alone); down writes the next layer's input x.
    Layer l's weights at w + l * size."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    met = 0
    for layer in range(layers):
        if WORK:
            _gemv_tiles(x_ptr, w0 + layer * (3 * H * H), y0, H, 3 * H, H, 3 * H, batch, pid, programs,
                        BLOCK_N, BLOCK_K, ROWS, True)
        met += programs
        _grid_barrier(counter_ptr, met)
        if WORK:
            _gemv_tiles(y0, w1 + layer * (H * H), y1, H, H, 3 * H, H, batch, pid, programs, BLOCK_N, BLOCK_K, ROWS, True)
        met += programs
        _grid_barrier(counter_ptr, met)
        if WORK:
            _gemv_tiles(y1, w2 + layer * (2 * I * H), y2, H, 2 * I, H, 2 * I, batch, pid, programs,
                        BLOCK_N, BLOCK_K, ROWS, True)
        met += programs
        _grid_barrier(counter_ptr, met)
        if WORK:
            _gemv_tiles(y2, w3 + layer * (H * I), x_ptr, I, H, 2 * I, H, batch, pid, programs,
                        BLOCK_N, BLOCK_K, ROWS, True)
        met += programs
        _grid_barrier(counter_ptr, met)
