"""Causal self-attention over MAX's paged KV cache for a ragged batch, CPU, float32.

Query `i` of sequence `b` (row `input_row_offsets[b] + i` of `q`) sits at position
`cache_lengths[b] + i`: `store_k/v_cache_ragged` have already written the step's own
keys and values behind the `cache_lengths[b]` the cache held before it, so the query
attends to keys `0 ..= cache_lengths[b] + i`. That one rule serves decode (one query
per sequence), prefill, chunked prefill and prefix-cache hits alike.

The cache is MAX's paged layout: `kv_blocks[page, k_or_v, layer, slot, kv_head, dim]`,
pages `page_stride` elements apart (`-1`: packed), key `j` of sequence `b` in page
`lookup_table[b, j / page_size]` at slot `j % page_size`.

A query computes its whole score row, its softmax in two passes (maximum, then
exponentials and their sum) and the probability-weighted sum of the values, so no
running rescale is needed. Steps with little work (a decode step over a short cache)
run on the calling thread, since waking workers would cost more than they share;
larger ones spread their units over the threads:

- a sequence with few query rows (decode) is one unit per share of its keys (all of
  them, unless there are fewer such sequences than threads): each score is a dot
  product with the key where the cache stores it, reading whole cache rows (every
  head of a slot), so each task streams one run of the layer's keys, then of its
  values, once per query row. Shares leave their softmax maxima, sums and value sums,
  which the last task to finish merges (as flash-decoding does). Cut by heads instead,
  every task would read part of every row, which streams slower over a long cache;
- a sequence with many (prefill) is one unit per head, which first copies the head's
  keys into a dimension-major scratch (`kt[d, j]`), so a tile of queries times sixteen
  keys is sixteen lanes of broadcast multiply-adds per dimension, with no horizontal
  sums; the copy is paid once per (sequence, head) and shared by all its queries. Its
  values are read in place into a register tile of output rows.
"""

from std.atomic import Atomic
from std.math import exp, fma

from max.algorithm import sync_parallelize

from .share import CpuCtx, F32Ptr

comptime U32Ptr = UnsafePointer[UInt32, MutUntrackedOrigin]
comptime KW = 16
"""Keys per score vector on the prefill path."""
comptime QT = 8
"""Queries per score tile on the prefill path: each loaded key vector serves QT rows."""
comptime FEW = 8
"""A (sequence, head) with fewer queries than this scores them by dot products."""
comptime PART[D: Int] = D + 16
"""Floats a (query row, head) leaves for `_merge`: its `D` value sums, then its maximum
and sum of exponentials (16 floats of room, which keeps the sums of a 64-value head
on 64-byte boundaries)."""
comptime SERIAL_WORK = 1 << 17
"""Below this many multiply-adds (query-key pairs times head_dim, whole batch) a step
runs on the calling thread."""


def _lanes[D: Int]() -> Int:
    """The widest vector (up to 16 float32 lanes) that divides a head."""
    if D % 16 == 0:
        return 16
    if D % 8 == 0:
        return 8
    if D % 4 == 0:
        return 4
    if D % 2 == 0:
        return 2
    return 1


@fieldwise_init
struct Pages(ImplicitlyCopyable, Movable):
    """Where one (sequence, kv head, layer)'s keys and values lie in the paged cache."""

    var blocks: F32Ptr
    """The first element of this layer and kv head's keys in page 0."""
    var lut: U32Ptr
    """The sequence's row of the lookup table."""
    var page_elems: Int
    var page_size: Int
    var row: Int
    """Elements from one slot to the next (kv heads times head_dim)."""
    var v_off: Int
    """Elements from a key to its value (layers times one layer's page)."""

    @always_inline
    def key(self, page: Int, slot: Int) -> F32Ptr:
        """Key `slot` of the sequence's `page`-th page (a lookup table column)."""
        var p = Int(self.lut.unsafe_load(page))
        return self.blocks + p * self.page_elems + slot * self.row

    @always_inline
    def value(self, page: Int, slot: Int) -> F32Ptr:
        return self.key(page, slot) + self.v_off


@always_inline
def _softmax_row(s: F32Ptr, n: Int, n_end: Int) -> Float32:
    """Exponentiates scores `s[0 : n]` relative to their maximum in place, zeroes
    `s[n : n_end]` (keys after the query, read by the value tile), and returns one
    over the sum of the exponentials."""
    var total = _exp_row(s, n)[1]
    for j in range(n, n_end):
        s.unsafe_store(j, 0)
    return 1 / total


@always_inline
def _exp_row(s: F32Ptr, n: Int) -> Tuple[Float32, Float32]:
    """Exponentiates scores `s[0 : n]` (n >= 1) relative to their maximum in place;
    returns the maximum and the sum of the exponentials."""
    var nv = (n // KW) * KW
    var m = s.unsafe_load(0)
    if nv:
        var mv = s.unsafe_load[width=KW](0)
        for j in range(KW, nv, KW):
            mv = max(mv, s.unsafe_load[width=KW](j))
        m = mv.reduce_max()
    for j in range(nv, n):
        m = max(m, s.unsafe_load(j))
    var acc = SIMD[DType.float32, KW](0)
    for j in range(0, nv, KW):
        var e = exp(s.unsafe_load[width=KW](j) - m)
        s.unsafe_store(j, e)
        acc += e
    var total = acc.reduce_add()
    for j in range(nv, n):
        var e = exp(s.unsafe_load(j) - m)
        s.unsafe_store(j, e)
        total += e
    return (m, total)


@always_inline
def _weighted_values[D: Int, pt: Int](
    o: F32Ptr, ldo: Int, s: F32Ptr, lds: Int, inv: F32Ptr, n: Int, pages: Pages
):
    """o[r] = inv[r] * sum_j s[r, j] * V[j] for rows r < pt over keys j < n."""
    comptime W = _lanes[D]()
    comptime NV = D // W
    var acc = Array[SIMD[DType.float32, W], pt * NV](fill=0)
    var j0 = 0
    var page = 0
    while j0 < n:
        var cnt = min(pages.page_size, n - j0)
        var v = pages.value(page, 0)
        for slot in range(cnt):
            var vp = v + slot * pages.row
            var vv = Array[SIMD[DType.float32, W], NV](fill=0)
            comptime for c in range(NV):
                vv[c] = vp.unsafe_load[width=W](c * W)
            comptime for r in range(pt):
                var p = SIMD[DType.float32, W](s.unsafe_load(r * lds + j0 + slot))
                comptime for c in range(NV):
                    acc[r * NV + c] = fma(p, vv[c], acc[r * NV + c])
        j0 += cnt
        page += 1
    comptime for r in range(pt):
        var scale = inv.unsafe_load(r)
        comptime for c in range(NV):
            o.unsafe_store(r * ldo + c * W, acc[r * NV + c] * scale)


def _values_rows[D: Int](
    o: F32Ptr, ldo: Int, s: F32Ptr, lds: Int, inv: F32Ptr, n_last: Int, rows: Int,
    pages: Pages,
):
    """`_weighted_values` for `rows` rows, in register tiles, each tile over the keys
    its last row sees (`n_last - rows + 1 + r` keys for row r)."""
    comptime W = _lanes[D]()
    comptime PT = max(1, min(4, 16 // (D // W)))
    var r0 = 0
    while r0 < rows:
        var pt = min(PT, rows - r0)
        var n = n_last - (rows - 1 - (r0 + pt - 1))
        comptime for k in range(1, PT + 1):
            if pt == k:
                _weighted_values[D, k](o + r0 * ldo, ldo, s + r0 * lds, lds, inv + r0, n, pages)
        r0 += pt


@always_inline
def _score_tile[D: Int, qt: Int](
    s: F32Ptr, lds: Int, q: F32Ptr, ldq: Int, kt: F32Ptr, ldk: Int, n: Int, scale: Float32
):
    """s[i, j] = scale * q[i] . k[j] for rows i < qt and keys j < n rounded up to KW,
    `kt` the keys dimension-major."""
    for j in range(0, n, KW):
        var acc = Array[SIMD[DType.float32, KW], qt](fill=0)
        for d in range(D):
            var kv = kt.unsafe_load[width=KW](d * ldk + j)
            comptime for i in range(qt):
                var qd = SIMD[DType.float32, KW](q.unsafe_load(i * ldq + d))
                acc[i] = fma(qd, kv, acc[i])
        comptime for i in range(qt):
            s.unsafe_store(i * lds + j, acc[i] * scale)


def _many_queries[D: Int](
    o: F32Ptr, q: F32Ptr, ld: Int, nq: Int, cache: Int, pages: Pages, scale: Float32,
    s: F32Ptr, kt: F32Ptr, ldk: Int, inv: F32Ptr,
):
    """A (sequence, head)'s `nq` query rows (`ld` apart in `q` and `o`) through the
    dimension-major copy of its keys."""
    var n = cache + nq
    var j0 = 0
    var page = 0
    while j0 < n:
        var cnt = min(pages.page_size, n - j0)
        var k = pages.key(page, 0)
        for slot in range(cnt):
            var kp = k + slot * pages.row
            for d in range(D):
                kt.unsafe_store(d * ldk + j0 + slot, kp.unsafe_load(d))
        j0 += cnt
        page += 1
    # Lanes past the last key feed scores no query reads; zeros keep them finite.
    for d in range(D):
        for j in range(n, ((n + KW - 1) // KW) * KW):
            kt.unsafe_store(d * ldk + j, 0)
    var i0 = 0
    while i0 < nq:
        var qt = min(QT, nq - i0)
        var n_last = cache + i0 + qt
        comptime for k in range(1, QT + 1):
            if qt == k:
                _score_tile[D, k](s, ldk, q + i0 * ld, ld, kt, ldk, n_last, scale)
        for i in range(qt):
            inv.unsafe_store(i, _softmax_row(s + i * ldk, n_last - qt + 1 + i, n_last))
        _values_rows[D](o + i0 * ld, ld, s, ldk, inv, n_last, qt, pages)
        i0 += qt


def _few_queries[D: Int](
    o: F32Ptr, q: F32Ptr, ld: Int, nq: Int, cache: Int, pages: Pages, scale: Float32,
    H: Int, group: Int, share: Int, shares: Int, part: F32Ptr,
    s: F32Ptr, lds: Int, inv: F32Ptr, acc: F32Ptr,
):
    """A sequence's `nq` query rows (`q` and `o` at head 0 of the first row, rows `ld`
    apart), every head, over share `share` of `shares` of each row's keys, each score a
    dot product with the key where the cache holds it. Keys and values are read a whole
    cache row (every head of a slot) at a time, so a task streams its share of the cache
    in one run, once per query row; the value sums build up in `acc` ([H, D], in L1).

    With one share a row's outputs go to `o` (`inv` holding one over each head's sum);
    with several, each share leaves its maxima, sums of exponentials and unscaled value
    sums in `part` (`PART` floats a row and head) for `_merge`."""
    comptime W = _lanes[D]()
    comptime NV = D // W
    for i in range(nq):
        var n = cache + i + 1
        var lo = share * n // shares
        var hi = (share + 1) * n // shares
        var qi = q + i * ld
        var j = lo
        while j < hi:
            var slot0 = j % pages.page_size
            var cnt = min(pages.page_size - slot0, hi - j)
            var k = pages.key(j // pages.page_size, slot0)
            for slot in range(cnt):
                var kr = k + slot * pages.row
                for h in range(H):
                    var qp = qi + h * D
                    var kp = kr + (h // group) * D
                    var a = qp.unsafe_load[width=W](0) * kp.unsafe_load[width=W](0)
                    comptime for c in range(1, NV):
                        a = fma(qp.unsafe_load[width=W](c * W), kp.unsafe_load[width=W](c * W), a)
                    s.unsafe_store(h * lds + j - lo + slot, a.reduce_add() * scale)
            j += cnt
        for h in range(H):
            if shares == 1:
                inv.unsafe_store(h, _softmax_row(s + h * lds, n, n))
            else:
                var ml = _exp_row(s + h * lds, hi - lo) if hi > lo else (Float32(0), Float32(0))
                var rp = part + (i * H + h) * PART[D]
                rp.unsafe_store(D, ml[0])
                rp.unsafe_store(D + 1, ml[1])
        for e in range(0, H * D, W):
            acc.unsafe_store(e, SIMD[DType.float32, W](0))
        j = lo
        while j < hi:
            var slot0 = j % pages.page_size
            var cnt = min(pages.page_size - slot0, hi - j)
            var v = pages.value(j // pages.page_size, slot0)
            for slot in range(cnt):
                var vr = v + slot * pages.row
                for h in range(H):
                    var vp = vr + (h // group) * D
                    var p = SIMD[DType.float32, W](s.unsafe_load(h * lds + j - lo + slot))
                    var ap = acc + h * D
                    comptime for c in range(NV):
                        ap.unsafe_store(c * W, fma(p, vp.unsafe_load[width=W](c * W), ap.unsafe_load[width=W](c * W)))
            j += cnt
        for h in range(H):
            if shares == 1:
                var scale_h = inv.unsafe_load(h)
                comptime for c in range(NV):
                    o.unsafe_store(i * ld + h * D + c * W, acc.unsafe_load[width=W](h * D + c * W) * scale_h)
            else:
                var rp = part + (i * H + h) * PART[D]
                comptime for c in range(NV):
                    rp.unsafe_store(c * W, acc.unsafe_load[width=W](h * D + c * W))


def _merge[D: Int](o: F32Ptr, ld: Int, nq: Int, H: Int, parts: F32Ptr, shares: Int):
    """A sequence's outputs from its `shares` partial results (`_few_queries`, one
    block of `FEW * H * PART` floats a share): each share's sums rescaled to the
    largest maximum, the value sums added and divided by the sums of exponentials."""
    comptime W = _lanes[D]()
    comptime NV = D // W
    for i in range(nq):
        for h in range(H):
            var at = (i * H + h) * PART[D]
            var top = Float32(0)
            var seen = False
            for k in range(shares):
                var rp = parts + k * FEW * H * PART[D] + at
                if rp.unsafe_load(D + 1) > 0:
                    top = max(top, rp.unsafe_load(D)) if seen else rp.unsafe_load(D)
                    seen = True
            var total = Float32(0)
            var out = Array[SIMD[DType.float32, W], NV](fill=0)
            for k in range(shares):
                var rp = parts + k * FEW * H * PART[D] + at
                if rp.unsafe_load(D + 1) > 0:
                    var f = exp(rp.unsafe_load(D) - top)
                    total += f * rp.unsafe_load(D + 1)
                    comptime for c in range(NV):
                        out[c] = fma(SIMD[DType.float32, W](f), rp.unsafe_load[width=W](c * W), out[c])
            comptime for c in range(NV):
                o.unsafe_store(i * ld + h * D + c * W, out[c] / total)


@fieldwise_init
struct AttentionPlan[head_dim: Int](ImplicitlyCopyable, Movable):
    """One step's attention cut into units of work (see `paged_attention`), for a fixed
    number of tasks: task `t` of `ntasks` runs units `t, t + ntasks, ...` (`run`)."""

    var o: F32Ptr
    var q: F32Ptr
    var offsets: U32Ptr
    var B: Int
    var H: Int
    var layer_base: F32Ptr
    var page_elems: Int
    var page_size: Int
    var row: Int
    var v_off: Int
    var group: Int
    var cache_lengths: U32Ptr
    var lut: U32Ptr
    var lut_cols: Int
    var scale: Float32
    var ldk: Int
    var splits: Int
    var units: Int
    var first_unit: UnsafePointer[Int, MutUntrackedOrigin]
    """first_unit[b]: the units of sequence b are first_unit[b] : first_unit[b + 1]."""
    var parts: F32Ptr
    """Unit u's partial results at `u * FEW * H * PART` when a sequence's keys are shared
    (one float, never read, when none is)."""
    var done: UnsafePointer[Atomic[Int64], MutUntrackedOrigin]
    """Tasks through `run`: the last one merges the shared sequences."""

    def pages(self, b: Int, kv_head: Int) -> Pages:
        """Where sequence `b`'s keys and values of `kv_head` lie in this layer."""
        return Pages(
            self.layer_base + kv_head * Self.head_dim, self.lut + b * self.lut_cols,
            self.page_elems, self.page_size, self.row, self.v_off,
        )

    def run(self, t: Int, ntasks: Int):
        comptime D = Self.head_dim
        var H = self.H
        var ldk = self.ldk
        var s = alloc[Float32](max(QT, H) * ldk + KW, alignment=64)
        var kt = alloc[Float32](D * ldk + KW, alignment=64)
        var inv = alloc[Float32](max(QT, H), alignment=64)
        var acc = alloc[Float32](H * D, alignment=64)
        for u in range(t, self.units, ntasks):
            # The sequence owning unit u: the last b with first_unit[b] <= u.
            var lo = 0
            var hi = self.B
            while hi - lo > 1:
                var mid = (lo + hi) // 2
                if self.first_unit.unsafe_load(mid) <= u:
                    lo = mid
                else:
                    hi = mid
            var b = lo
            while self.first_unit.unsafe_load(b + 1) <= u:
                b += 1
            var k = u - self.first_unit.unsafe_load(b)
            var first = Int(self.offsets.unsafe_load(b))
            var nq = Int(self.offsets.unsafe_load(b + 1)) - first
            var cache = Int(self.cache_lengths.unsafe_load(b))
            var at = first * H * D
            if nq < FEW:
                _few_queries[D](
                    self.o + at, self.q + at, H * D, nq, cache, self.pages(b, 0), self.scale,
                    H, self.group, k, self.splits, self.parts + u * FEW * H * PART[D],
                    s, ldk, inv, acc,
                )
            else:
                var pages = self.pages(b, k // self.group)
                _many_queries[D](
                    self.o + at + k * D, self.q + at + k * D, H * D, nq, cache, pages,
                    self.scale, s, kt, ldk, inv,
                )
        s.free()
        kt.free()
        inv.free()
        acc.free()
        if self.splits > 1 and Int(self.done[0].fetch_add(1)) == ntasks - 1:
            self.merge()

    def merge(self):
        """The outputs of the sequences whose keys the units shared (`_merge`)."""
        comptime D = Self.head_dim
        for b in range(self.B):
            var first = Int(self.offsets.unsafe_load(b))
            var nq = Int(self.offsets.unsafe_load(b + 1)) - first
            if 0 < nq < FEW:
                _merge[D](
                    self.o + first * self.H * D, self.H * D, nq, self.H,
                    self.parts + self.first_unit.unsafe_load(b) * FEW * self.H * PART[D],
                    self.splits,
                )

    def free(self):
        self.first_unit.free()
        self.parts.free()
        self.done.unsafe_bitcast[Int64]().free()


def attention_work(offsets: U32Ptr, B: Int, cache_lengths: U32Ptr) -> Int:
    """Query-key pairs of the whole batch."""
    var work = 0
    for b in range(B):
        var nq = Int(offsets.unsafe_load(b + 1)) - Int(offsets.unsafe_load(b))
        work += nq * (Int(cache_lengths.unsafe_load(b)) + nq)
    return work


def plan_attention[D: Int](
    o: F32Ptr, q: F32Ptr, offsets: U32Ptr, B: Int, H: Int,
    blocks: F32Ptr, page_elems: Int, L: Int, page_size: Int, Hkv: Int, layer: Int,
    cache_lengths: U32Ptr, lut: U32Ptr, lut_cols: Int, scale: Float32, ntasks: Int,
) -> AttentionPlan[D]:
    """The units of `paged_attention`'s work for `ntasks` tasks (free it with `free`).

    A unit is one head of a sequence with many query rows, or a share of the keys of
    one with few: all of them when there are at least as many such sequences as tasks,
    else a task's share, so a single decode row still spreads over the threads, each
    streaming whole cache rows, and the last task to finish merges the shares."""
    var row = Hkv * D
    var most_keys = 0
    var few = 0
    for b in range(B):
        var nq = Int(offsets.unsafe_load(b + 1)) - Int(offsets.unsafe_load(b))
        if nq:
            most_keys = max(most_keys, Int(cache_lengths.unsafe_load(b)) + nq)
        if nq and nq < FEW:
            few += 1
    var splits = max(1, min(H, ntasks // max(1, few)))
    var first_unit = alloc[Int](B + 1)
    first_unit.unsafe_store(0, 0)
    for b in range(B):
        var nq = Int(offsets.unsafe_load(b + 1)) - Int(offsets.unsafe_load(b))
        var count = 0 if nq == 0 else (splits if nq < FEW else H)
        first_unit.unsafe_store(b + 1, first_unit.unsafe_load(b) + count)
    var units = first_unit.unsafe_load(B)
    var parts = alloc[Float32](units * FEW * H * PART[D] if splits > 1 else 1, alignment=64)
    var done = alloc[Int64](1)
    done.unsafe_store(0, 0)
    return AttentionPlan[D](
        o, q, offsets, B, H, blocks + layer * page_size * row, page_elems, page_size, row,
        L * page_size * row, H // Hkv, cache_lengths, lut, lut_cols, scale,
        ((most_keys + KW - 1) // KW) * KW, splits, units, first_unit, parts,
        done.unsafe_bitcast[Atomic[Int64]](),
    )


def attention_tasks(
    offsets: U32Ptr, B: Int, cache_lengths: U32Ptr, H: Int, D: Int, max_tasks: Int
) -> Int:
    """How many tasks a step's attention is planned for: one below `SERIAL_WORK`."""
    return 1 if attention_work(offsets, B, cache_lengths) * H * D < SERIAL_WORK else max(1, max_tasks)


def run_attention[D: Int](plan: AttentionPlan[D], ntasks: Int, ctx: Optional[CpuCtx]) raises:
    """Every unit of `plan` (made for `ntasks` tasks), on the calling thread when one
    task is all it needs."""
    var tasks = min(ntasks, max(1, plan.units))

    def task(t: Int) {imm plan, imm tasks}:
        plan.run(t, tasks)

    if tasks == 1:
        plan.run(0, 1)
    else:
        sync_parallelize(task, tasks, ctx)


def paged_attention[D: Int](
    o: F32Ptr, q: F32Ptr, offsets: U32Ptr, B: Int, H: Int,
    blocks: F32Ptr, page_elems: Int, L: Int, page_size: Int, Hkv: Int, layer: Int,
    cache_lengths: U32Ptr, lut: U32Ptr, lut_cols: Int, scale: Float32,
    max_tasks: Int, ctx: Optional[CpuCtx],
) raises:
    """Attention of every query row of `q` ([rows, H, D]) into `o`, see the module doc,
    on up to `max_tasks` tasks (`plan_attention`'s units)."""
    var ntasks = attention_tasks(offsets, B, cache_lengths, H, D, max_tasks)
    var plan = plan_attention[D](
        o, q, offsets, B, H, blocks, page_elems, L, page_size, Hkv, layer,
        cache_lengths, lut, lut_cols, scale, ntasks,
    )
    run_attention(plan, ntasks, ctx)
    plan.free()
