"""A measurement prototype for the persistent layer kernel (decision 0023, "What is left for 85%"): the decode
step's GEMM chain (q/k/v -> o -> gate/up + SwiGLU -> down over every layer, as ``bench_decode_linear``'s
:class:`Chain`) as ONE kernel launch.

One program per multiprocessor walks the chain. In each GEMM it takes the weight tiles ``pid, pid + P, ...``
(the decode kernel's launch parameters per shape: ``triton_linear.config_for``), then all programs meet at a
grid-wide barrier (an arrival counter: a CTA barrier, a release add, acquire polls) before the next GEMM reads
what this one wrote. Before it waits, each program prefetches to L2 the head of its first weight tile of the
next GEMM: the weights do not depend on the activations, so the next GEMM's fill overlaps this one's tail, which
is what the kernel boundaries of the PDL chain cost. The question it answers: how much of the gap between the
PDL chain and the copy bandwidth a persistent kernel closes, before anyone builds attention, RoPE and the norms
into one.

``dataflow`` replaces the barriers with one flag per producer tile: a GEMM walks its K in segments (as many as
its producer has waves of tiles over the programs), each a software-pipelined loop that starts once the producer
tiles of its columns have set their flags (release after the tile's stores; acquire polls), so a consumer starts
on the columns of the producer's first wave while later waves still run. Every tile still waits for all of its K,
so each overwrite of an activation buffer waits, through that chain of flags, for every read of it.

Not an engine path: the grid barrier needs every program resident at once (one per multiprocessor, nothing else
on the GPU), activations are read through L2 (``.cg``: other multiprocessors wrote them), and the counter and
the flags are zeroed before each launch. Same tiles and the same K order as the decode kernel, so the output
equals the per-GEMM chain's (checked before timing). In Triton's CPU interpreter it runs as one program (barriers
and flags pass at once), which the CPU test uses.
"""

from __future__ import annotations

import torch

from lumenrl_backends.engines import triton_linear as tlin

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU environments without Triton
    triton = None

ROWS = 64  # one row tile: the decode batch

if triton is not None:
    from lumenrl_backends.engines.triton_linear import _operand, _prefetch_rows
    from lumenrl_backends.engines.triton_rope import _round

    @triton.jit
    def _grid_sync(counter, target, EMULATED: tl.constexpr):
        """Every program's writes so far visible to every program after it (a grid-wide barrier; the interpreter's
        single program passes)."""
        if EMULATED:
            return
        tl.debug_barrier()
        tl.atomic_add(counter, 1, sem="release", scope="gpu")
        # poll with acquire loads (an atomic per poll from every program serializes at the counter's L2 slice, in
        # front of the arrivals); the load that sees the target orders what follows after every arrival's writes
        while _load_acquire(counter) < target:
            pass
        tl.debug_barrier()

    @triton.jit
    def _load_acquire(ptr):
        """``ld.acquire.gpu`` of one int32."""
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def _now(pid):
        """The GPU's global nanosecond timer (``%globaltimer``; ``pid`` is an unused operand)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _barriers_kernel(counter, COUNT: tl.constexpr):
        """``COUNT`` grid barriers and nothing else: what one costs."""
        nprog = tl.num_programs(0)
        for phase in range(1, COUNT + 1):
            _grid_sync(counter, phase * nprog, False)

    @triton.jit
    def _wait_tiles(flags, first, COUNT: tl.constexpr):
        """Wait until tiles ``first .. first + COUNT`` of a producer GEMM have set their flags (acquire loads, in
        power-of-two chunks of up to 128 flags)."""
        CHUNK: tl.constexpr = COUNT if COUNT < 128 else 128
        tl.static_assert(COUNT % CHUNK == 0, "a flag wait covers whole chunks (else it would wait on unset flags)")
        for c in tl.static_range(0, COUNT, CHUNK):
            offs = first + c + tl.arange(0, CHUNK)
            while tl.min(_load_acquire(flags + offs), axis=0) == 0:
                pass
        tl.debug_barrier()

    @triton.jit
    def _tile(x_ptr, stride_x, w_ptr, out_ptr, stride_o, M, tile, flag_in, flag_out, N: tl.constexpr,
              K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
              SWIGLU: tl.constexpr, EMULATED: tl.constexpr, SEG: tl.constexpr, BN_IN: tl.constexpr,
              FLOW: tl.constexpr, TRACE: tl.constexpr):
        """One weight tile of out = x @ w.T (SWIGLU: w = cat([gate, up]) of 2N rows, out = silu(gate) * up, rounded
        as the decode kernel's epilogue). FLOW (dataflow instead of grid barriers): K is walked in segments of SEG
        columns, each a pipelined loop of its own that starts once the producer tiles (BN_IN columns each) of its
        columns have set their flags (BN_IN = 0: the input has no producer); the tile then sets its own flag.
        Returns the nanoseconds spent in flag waits (TRACE; else 0)."""
        waited = tl.zeros((), dtype=tl.int64)
        offs_m = tl.arange(0, 64)
        mmask = offs_m < M
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        acc = tl.zeros((64, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((64, BLOCK_N), dtype=tl.float32)
        for seg in range(0, K, SEG):  # a loop, not unrolled: one copy of the pipelined K loop and its registers
            if FLOW and BN_IN > 0 and not EMULATED:  # the wait comes before the segment's first copy is issued
                if TRACE:
                    t0 = _now(tile)
                _wait_tiles(flag_in, seg // BN_IN, SEG // BN_IN)
                if TRACE:
                    waited += _now(tile) - t0
            for _ in tl.range(0, SEG, BLOCK_K, num_stages=STAGES):
                x = _operand(tl.load(x_ptrs, mask=mmask[:, None], other=0.0, cache_modifier=".cg"), EMULATED)
                acc = tl.dot(x, tl.trans(_operand(tl.load(w_ptrs), EMULATED)), acc)
                if SWIGLU:
                    acc_u = tl.dot(x, tl.trans(_operand(tl.load(w_ptrs + N * K), EMULATED)), acc_u)
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
        dt = out_ptr.dtype.element_ty
        if SWIGLU:
            gate = _round(acc, dt, EMULATED).to(tl.float32)
            up = _round(acc_u, dt, EMULATED).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], _round(acc, dt, EMULATED), mask=mmask[:, None])
        if FLOW and not EMULATED:  # every thread's stores, then one release
            tl.debug_barrier()
            tl.atomic_xchg(flag_out + tile, 1, sem="release", scope="gpu")
        return waited

    @triton.jit
    def _gemm(x_ptr, stride_x, w_ptr, out_ptr, stride_o, M, pid, nprog, flag_in, flag_out, N: tl.constexpr,
              K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
              SWIGLU: tl.constexpr, EMULATED: tl.constexpr, SEG: tl.constexpr, BN_IN: tl.constexpr,
              FLOW: tl.constexpr, trace, TRACE: tl.constexpr):
        """The weight tiles pid, pid + nprog, ... of one GEMM (the interpreter's single program: every tile; it
        takes no run-time loop bounds). TRACE: ``trace[0:3]`` = the time it began, the nanoseconds of its flag waits,
        the time it ended."""
        if EMULATED:
            for tile in range(0, N // BLOCK_N):
                _tile(x_ptr, stride_x, w_ptr, out_ptr, stride_o, M, tile, flag_in, flag_out, N, K, BLOCK_N, BLOCK_K,
                      STAGES, SWIGLU, EMULATED, SEG, BN_IN, FLOW, False)
        else:
            if TRACE:
                tl.store(trace, _now(pid))
            waited = tl.zeros((), dtype=tl.int64)
            for tile in range(pid, N // BLOCK_N, nprog):
                waited += _tile(x_ptr, stride_x, w_ptr, out_ptr, stride_o, M, tile, flag_in, flag_out, N, K, BLOCK_N,
                                BLOCK_K, STAGES, SWIGLU, EMULATED, SEG, BN_IN, FLOW, TRACE)
            if TRACE:
                tl.store(trace + 1, waited)
                tl.store(trace + 2, _now(pid))

    @triton.jit
    def _next(w, pid, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
              LINE: tl.constexpr):
        """L2 prefetch of the head of this program's first weight tile of the next GEMM (rows ``pid * BLOCK_N``...)."""
        if PREFETCH > 0:  # noqa: SIM102 - a compile-time branch around a run-time one
            if pid < N // BLOCK_N:
                _prefetch_rows(w, pid * BLOCK_N + tl.arange(0, BLOCK_N), K, PREFETCH, LINE)

    @triton.jit
    def _chain_kernel(
        x0, wq, wo, wgu, wd, y1, y2, y3, out, counter, flags, trace, M, LAYERS: tl.constexpr,
        H: tl.constexpr, QKV: tl.constexpr, QW: tl.constexpr, INTER: tl.constexpr,
        BN1: tl.constexpr, BK1: tl.constexpr, S1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
        S2: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr, S3: tl.constexpr, BN4: tl.constexpr,
        BK4: tl.constexpr, S4: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, EMULATED: tl.constexpr,
        FLOW: tl.constexpr, SEG1: tl.constexpr, SEG2: tl.constexpr, SEG3: tl.constexpr, SEG4: tl.constexpr,
        MAXT: tl.constexpr, TRACE: tl.constexpr,
    ):
        # the weights: one (LAYERS, N, K) tensor per GEMM, so the compiler knows each layer's tile alignment (an
        # address loaded from a table is opaque to it: the weight loads then leave the software pipeline).
        # FLOW: no grid barriers; GEMM g of layer l sets flags[(4 l + g) * MAXT + tile] (zeroed before the launch)
        # the activations: two buffers each of 64 rows, by layer parity. Pointers that depend on the layer are
        # computed in each layer; pointers into one buffer would be loop invariants, hoisted out of the layer loop
        # (64-bit pointer tensors of every GEMM's x tile held across the loop: past 255 registers under FLOW).
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        phase = 0
        for layer in range(0, LAYERS):
            at = tl.cast(layer, tl.int64)  # the gate/up stack passes 2**31 elements
            w_qkv, w_o, w_gu, w_d = wq + at * (QKV * H), wo + at * (H * QW), wgu + at * (2 * INTER * H), wd + at * (H * INTER)
            f = flags + layer * 4 * MAXT  # this layer's q/k/v, o, gate/up, down flags: f, f + MAXT, ...
            par = layer % 2
            a1, a2, a3 = y1 + par * (64 * QKV), y2 + par * (64 * H), y3 + par * (64 * INTER)
            a_in, a_out = out + (1 - par) * (64 * H), out + par * (64 * H)
            tr = trace + (pid * LAYERS + layer) * 12  # TRACE: 3 numbers per GEMM of this program and layer
            if layer == 0:
                _gemm(x0, H, w_qkv, a1, QKV, M, pid, nprog, f, f, QKV, H, BN1, BK1, S1, False, EMULATED, H, 0, FLOW,
                      tr, TRACE)
            else:
                _gemm(a_in, H, w_qkv, a1, QKV, M, pid, nprog, f - MAXT, f, QKV, H, BN1, BK1, S1, False, EMULATED,
                      SEG1, BN4, FLOW, tr, TRACE)
            _next(w_o, pid, H, QW, BN2, PREFETCH, LINE)
            phase += 1
            if not FLOW:
                _grid_sync(counter, phase * nprog, EMULATED)
            _gemm(a1, QKV, w_o, a2, H, M, pid, nprog, f, f + MAXT, H, QW, BN2, BK2, S2, False, EMULATED, SEG2, BN1,
                  FLOW, tr + 3, TRACE)  # o reads the q columns
            _next(w_gu, pid, INTER, H, BN3, PREFETCH, LINE)
            phase += 1
            if not FLOW:
                _grid_sync(counter, phase * nprog, EMULATED)
            _gemm(a2, H, w_gu, a3, INTER, M, pid, nprog, f + MAXT, f + 2 * MAXT, INTER, H, BN3, BK3, S3, True,
                  EMULATED, SEG3, BN2, FLOW, tr + 6, TRACE)
            _next(w_d, pid, H, INTER, BN4, PREFETCH, LINE)
            phase += 1
            if not FLOW:
                _grid_sync(counter, phase * nprog, EMULATED)
            _gemm(a3, INTER, w_d, a_out, H, M, pid, nprog, f + 2 * MAXT, f + 3 * MAXT, H, INTER, BN4, BK4, S4, False,
                  EMULATED, SEG4, BN3, FLOW, tr + 9, TRACE)
            if layer + 1 < LAYERS:
                _next(w_qkv + QKV * H, pid, QKV, H, BN1, PREFETCH, LINE)
            phase += 1
            if not FLOW:
                _grid_sync(counter, phase * nprog, EMULATED)


class PersistentChain:
    """The chain of ``weights`` (a list per layer of {"qkv", "o", "gate_up", "down"} bf16 (N, K) weights, o reading
    the first ``q_width`` columns of q/k/v's output) as one launch over ``x`` (M <= 64, K = the model width)."""

    def __init__(self, weights: list[dict[str, torch.Tensor]], q_width: int, programs: int | None = None,
                 prefetch: int = tlin.PDL_PREFETCH, num_warps: int = 4) -> None:
        if triton is None:
            raise RuntimeError("the persistent chain needs Triton")
        first = weights[0]
        self.qkv, self.hidden = first["qkv"].shape
        self.inter = first["gate_up"].shape[0] // 2
        self.q_width, self.layers = q_width, len(weights)
        device = first["qkv"].device
        for w in weights:
            for name, t in w.items():
                if t.dtype != torch.bfloat16 or not t.is_contiguous():
                    raise ValueError(f"weight {name} {t.dtype}, contiguous={t.is_contiguous()}; need contiguous bf16")
        # one (layers, N, K) tensor per GEMM (a copy: the chain's weights stay as they are)
        self.stacked = [torch.stack([w[n] for w in weights]) for n in ("qkv", "o", "gate_up", "down")]
        shapes = ((self.qkv, self.hidden, False), (self.hidden, q_width, False), (self.inter, self.hidden, True),
                  (self.hidden, self.inter, False))
        self.configs = [tlin.config_for(n, k, device, swiglu=s) for n, k, s in shapes]
        self.table_stages = tuple(c["num_stages"] for c in self.configs)
        if tlin.INTERPRETED or device.type != "cuda":
            self.programs = 1  # the interpreter runs programs one after another: one program, every tile
        else:
            self.programs = programs or torch.cuda.get_device_properties(device).multi_processor_count
        self.prefetch = 0 if tlin.INTERPRETED else prefetch
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.num_warps = num_warps
        self.dataflow = False  # flags per producer tile instead of grid barriers (set it to time that)
        self.flow_segments = True  # under dataflow, K in segments by the producer's waves (False: one wait per tile)
        self.trace: torch.Tensor | None = None  # (programs, layers, 4 GEMMs, 3) timestamps: see timeline()
        self.wave_programs = self.programs  # the program count segments() splits producer tiles into waves by
        self.max_tiles = max(n // c["block_n"] for (n, _, _), c in zip(shapes, self.configs, strict=True))
        self.flags = torch.zeros(self.layers * 4 * self.max_tiles, dtype=torch.int32, device=device)

    def segments(self) -> tuple[int, int, int, int]:
        """Columns of K each GEMM walks per flag wait under dataflow: as many segments as its producer has waves
        of tiles over the programs (the first segment's tiles are all in the first wave), where the segment is a
        whole number of K steps and a power-of-two count of producer tiles; else one segment, the whole K."""
        ks = (self.hidden, self.q_width, self.hidden, self.inter)  # each GEMM's K
        producers = (self.configs[3], self.configs[0], self.configs[1], self.configs[2])  # who writes its input
        n_out = (self.hidden, self.qkv, self.hidden, self.inter)  # the producers' N
        out = []
        for k, cfg, prod, n in zip(ks, self.configs, producers, n_out, strict=True):
            waves = -(-(n // prod["block_n"]) // self.wave_programs)
            seg = k // waves if k % waves == 0 else k
            tiles = seg // prod["block_n"]
            if seg % cfg["block_k"] or seg % prod["block_n"] or tiles & (tiles - 1):
                seg = k
            out.append(seg)
        return tuple(out)

    def set_stages(self, stages: tuple[int, int, int, int] | None) -> None:
        """Pipeline stages per GEMM (q/k/v, o, gate/up, down); None: the decode kernel's table. One program per
        multiprocessor holds the largest GEMM's buffers anyway, so the smaller ones may use deeper pipelines."""
        for cfg, n in zip(self.configs, stages or self.table_stages, strict=True):
            cfg["num_stages"] = n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m > ROWS or x.shape[1] != self.hidden or x.dtype != torch.bfloat16:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype}; need (M <= {ROWS}, {self.hidden}) bfloat16")
        y1 = x.new_empty((2, ROWS, self.qkv))  # by layer parity, 64 rows each (the kernel's fixed offsets)
        y2 = x.new_empty((2, ROWS, self.hidden))
        y3 = x.new_empty((2, ROWS, self.inter))
        out = x.new_empty((2, ROWS, self.hidden))
        self.counter.zero_()
        self.flags.zero_()
        c1, c2, c3, c4 = self.configs
        whole = (self.hidden, self.q_width, self.hidden, self.inter)
        seg1, seg2, seg3, seg4 = self.segments() if self.dataflow and self.flow_segments else whole
        trace = self.trace if self.trace is not None else self.counter
        _chain_kernel[(self.programs,)](
            x, *self.stacked, y1, y2, y3, out, self.counter, self.flags, trace, m, self.layers,
            H=self.hidden, QKV=self.qkv, QW=self.q_width, INTER=self.inter,
            BN1=c1["block_n"], BK1=c1["block_k"], S1=c1["num_stages"], BN2=c2["block_n"], BK2=c2["block_k"],
            S2=c2["num_stages"], BN3=c3["block_n"], BK3=c3["block_k"], S3=c3["num_stages"], BN4=c4["block_n"],
            BK4=c4["block_k"], S4=c4["num_stages"], PREFETCH=self.prefetch, LINE=64, EMULATED=tlin.INTERPRETED,
            FLOW=self.dataflow, SEG1=seg1, SEG2=seg2, SEG3=seg3, SEG4=seg4, MAXT=self.max_tiles,
            TRACE=self.trace is not None and not tlin.INTERPRETED, num_warps=self.num_warps,
        )
        return out[(self.layers - 1) % 2, :m]


def timeline(chain: PersistentChain, x: torch.Tensor) -> dict:
    """Where one launch of ``chain`` spends its time, from timestamps each program takes (``%globaltimer``) as it
    enters and leaves each GEMM, and the nanoseconds it spends in flag waits (dataflow). Microseconds, averaged
    over layers 1 .. L-1 and over the programs that have tiles of that GEMM:

    * ``layer_us``: from one layer's first q/k/v entry to the next's (the chain's steady time per layer);
    * per GEMM (``qkv``, ``o``, ``gate_up``, ``down``): ``busy`` (in the GEMM, not waiting for flags), ``flag_wait``,
      ``gap`` (from leaving the previous GEMM to entering this one: the L2 prefetch and, with barriers, the barrier),
      ``span`` (first entry to last exit) and ``tail`` (last exit minus the median exit)."""
    chain.trace = torch.zeros((chain.programs, chain.layers, 4, 3), dtype=torch.int64, device=x.device)
    try:
        chain(x)
        torch.cuda.synchronize(x.device)
        t = chain.trace.double().cpu()
    finally:
        chain.trace = None
    p, layers = chain.programs, chain.layers
    n = (chain.qkv, chain.hidden, chain.inter, chain.hidden)
    working = [torch.tensor([pid < n_g // cfg["block_n"] for pid in range(p)]) for n_g, cfg in zip(n, chain.configs,
                                                                                                      strict=True)]
    out = {"layer_us": float((t[:, 1:, 0, 0].min(0).values.diff()).mean() / 1e3) if layers > 2 else None}
    for g, name in enumerate(("qkv", "o", "gate_up", "down")):
        w = working[g]
        enter, waited, leave = t[w, 1:, g, 0], t[w, 1:, g, 1], t[w, 1:, g, 2]
        prev = t[w, 1:, g - 1, 2] if g else t[w, :-1, 3, 2]  # leaving the GEMM before (q/k/v: the last layer's down)
        out[name] = {
            "busy": round(float((leave - enter - waited).mean()) / 1e3, 2),
            "flag_wait": round(float(waited.mean()) / 1e3, 2),
            "gap": round(float((enter - prev).mean()) / 1e3, 2),
            "span": round(float((leave.max(0).values - enter.min(0).values).mean()) / 1e3, 2),
            "tail": round(float((leave.max(0).values - leave.median(0).values).mean()) / 1e3, 2),
        }
    return out


def interpreted_check() -> dict:
    """Two tiny layers through :class:`PersistentChain` and through the per-GEMM decode kernel, under Triton's CPU
    interpreter (:func:`benchmarks.quant._common.run_interpreted`): whether the bits agree."""
    gen = torch.Generator().manual_seed(7)
    hidden, qkv, inter = 64, 128, 256

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)

    weights = [{"qkv": weight(qkv, hidden), "o": weight(hidden, hidden), "gate_up": weight(2 * inter, hidden),
                "down": weight(hidden, inter)} for _ in range(2)]
    x = torch.randn(5, hidden, generator=gen).to(torch.bfloat16)
    chain = PersistentChain(weights, q_width=hidden)
    out = chain(x)
    chain.dataflow = True  # the K loops in segments (the interpreter's one program needs no flag waits)
    chain.wave_programs = 4  # segments as 4 programs would wave: down walks its 256 columns in two
    flow = chain(x)
    h = x
    for w in weights:
        h = tlin.decode_linear(tlin.decode_linear(h, w["qkv"])[:, :hidden], w["o"])
        h = tlin.decode_linear(tlin.decode_linear(h, w["gate_up"], swiglu=True), w["down"])
    return {"equal": torch.equal(out, h), "max_abs": float((out.float() - h.float()).abs().max()),
            "dataflow_equal": torch.equal(flow, h), "segments": chain.segments()}


def barrier_us(device: torch.device, count: int = 144, programs: int | None = None) -> float:
    """Microseconds per grid barrier of :func:`_grid_sync` on ``device``: ``count`` barriers of one program per
    multiprocessor in one launch, in a CUDA graph (the counter zeroed in it), per barrier."""
    from benchmarks.gpu._common import time_graph_ms

    programs = programs or torch.cuda.get_device_properties(device).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int32, device=device)

    def run() -> torch.Tensor:
        counter.zero_()
        _barriers_kernel[(programs,)](counter, COUNT=count, num_warps=4)
        return counter

    run()
    ms, _ = time_graph_ms([run])
    return ms * 1e3 / count
