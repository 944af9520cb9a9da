"""A design check of ffi/mla_verify.cu's NarrowKernel without a GPU: the kernel emulated lane by lane in numpy,
with the PTX fragment layouts of ldmatrix (x4, and .trans) and mma.m16n8k16 (bf16, fp32 accumulators) written out
as the PTX ISA defines them, and every address and index expression of the kernel copied as it is in the .cu file
(shared-memory offsets, the lanes' ldmatrix rows, the B fragments read from Q and P, the masked online softmax,
the shuffles over the lanes of one row, the partials and stats). The partials are combined as the CombineKernel
does and compared with float64 attention over the same keys (the prefix, then the tree slots the mask allows, at
the clamped slots when the tree would run past the cache, as BlockKeys maps them).

It checks the kernel's index math against the fragment layouts, not the hardware: the GPU tests
(tests/test_mla_verify.py, every fast-path case on both kernels) are the test. Run it after changing the kernel:

    python scripts/emulate_mla_narrow.py      # ~10 s; prints the relative error of each case (bf16 P: ~1e-3)
"""

import numpy as np

kRank, kRope, kKeys = 512, 64, 64
kChunks = (kRank + kRope) // 8
kNarrowWarps, kNarrowRows = 4, 32
kRowBytes = 2 * (kRank + kRope) + 16
kNarrowStage = kKeys * kRowBytes
kPStride = 2 * kKeys + 16
kNarrowSmemQ = 2 * kNarrowStage
kNarrowSmemP = kNarrowSmemQ + kNarrowRows * kRowBytes
kNarrowSmem = kNarrowSmemP + kNarrowWarps * 8 * kPStride


def bf16(x):
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def f32(u16):
    return (np.asarray(u16, np.uint32) << 16).view(np.float32)


class Smem:
    def __init__(self, n):
        self.b = np.zeros(n, np.uint8)

    def write16(self, addr, vals_u16):  # 8 bf16 = 16 bytes
        self.b[addr : addr + 16] = np.asarray(vals_u16, np.uint16).view(np.uint8)

    def zero16(self, addr):
        self.b[addr : addr + 16] = 0

    def u16(self, addr):
        return int(self.b[addr : addr + 2].view(np.uint16)[0])

    def set_u16(self, addr, v):
        self.b[addr : addr + 2] = np.array([v], np.uint16).view(np.uint8)

    def u32(self, addr):
        assert addr % 4 == 0
        return int(self.b[addr : addr + 4].view(np.uint32)[0])


def pair(u32):
    return f32(np.array([u32 & 0xFFFF, u32 >> 16]))


def ldsm4(sm, addrs, trans):  # addrs[lane]; returns regs[lane][4] as float pairs (2,)
    out = np.zeros((32, 4, 2), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            if not trans:
                a = addrs[8 * i + g]
                assert a % 16 == 0
                out[lane, i, 0] = f32(sm.u16(a + 4 * t))
                out[lane, i, 1] = f32(sm.u16(a + 4 * t + 2))
            else:
                a0, a1 = addrs[8 * i + 2 * t], addrs[8 * i + 2 * t + 1]
                assert a0 % 16 == 0
                out[lane, i, 0] = f32(sm.u16(a0 + 2 * g))
                out[lane, i, 1] = f32(sm.u16(a1 + 2 * g))
    return out


def mma(c, a, b0, b1):  # c [32,4], a [32,4,2], b0/b1 [32,2]
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2 * t : 2 * t + 2] = a[lane, 0]
        A[g + 8, 2 * t : 2 * t + 2] = a[lane, 1]
        A[g, 2 * t + 8 : 2 * t + 10] = a[lane, 2]
        A[g + 8, 2 * t + 8 : 2 * t + 10] = a[lane, 3]
        B[2 * t : 2 * t + 2, g] = b0[lane]
        B[2 * t + 8 : 2 * t + 10, g] = b1[lane]
    D = A.astype(np.float64) @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def shfl_xor(v, m):  # v [32, ...]
    return v[np.arange(32) ^ m]


def run_block(p, bx, split, b, sm):
    # BlockKeys
    ln = p["lens"][b]
    prefix = min(max(ln, 0), p["s"])
    tree0 = min(max(ln, 0), p["s"] - p["n"])
    keys = prefix + p["n"]
    tiles = (keys + kKeys - 1) // kKeys
    per = (tiles + p["splits"] - 1) // p["splits"]
    first = split * per
    count = max(0, min(tiles, first + per) - first)
    shift = tree0 - prefix
    m0 = bx * kNarrowRows

    def copy(dst, count_rows, lat, rope, row_of):
        for c in range(count_rows * kChunks):
            row, ch = divmod(c, kChunks)
            ok, src = row_of(row)
            d = dst + row * kRowBytes + ch * 16
            if not ok:
                sm.zero16(d)
                continue
            v = lat[src, ch * 8 : ch * 8 + 8] if ch < kRank // 8 else rope[src, (ch - 64) * 8 : (ch - 64) * 8 + 8]
            sm.write16(d, v)

    def load_tile(i):
        k0 = (first + i) * kKeys

        def row_of(row):
            v = k0 + row
            ok = v < keys
            return ok, (b * p["s"] + (v if v < prefix else v + shift)) if ok else 0

        copy((i & 1) * kNarrowStage, kKeys, p["latent"], p["pe"], row_of)

    if count > 0:
        copy(
            kNarrowSmemQ,
            kNarrowRows,
            p["q_lat"],
            p["q_pe"],
            lambda row: ((m0 + row < p["m"]), (b * p["m"] + m0 + row) if m0 + row < p["m"] else 0),
        )
        load_tile(0)
    lanes = np.arange(32)
    g = lanes >> 2
    t = lanes & 3
    li = lanes >> 3
    lr = lanes & 7
    warps = []
    for w in range(kNarrowWarps):
        wrow = m0 + 8 * w
        st = dict(
            active=wrow < p["m"],
            o=np.zeros((32, 32, 4)),
            mrun=np.full((32, 2), -np.inf),
            lrun=np.zeros((32, 2)),
            wrow=wrow,
        )
        warps.append(st)
    for i in range(count):
        if i + 1 < count:
            load_tile(i + 1)
        tile = (i & 1) * kNarrowStage
        for w, st in enumerate(warps):
            if not st["active"]:
                continue
            wrow = st["wrow"]
            qm = wrow + 2 * t[:, None] + np.arange(2)[None, :]  # [32, 2]
            real = qm < p["m"]
            n_of = np.where(real, qm // p["h"], 0)
            q_row = kNarrowSmemQ + (8 * w + g) * kRowBytes
            k_lane = (lr + 8 * (li & 1)) * kRowBytes + 16 * (li >> 1)
            v_lane = (lr + 8 * (li >> 1)) * kRowBytes + 16 * (li & 1)
            s = np.zeros((4, 32, 4))
            for kk in range(kChunks // 2):
                b0 = np.array([pair(sm.u32(q_row[ln] + 32 * kk + 4 * t[ln])) for ln in range(32)])
                b1 = np.array([pair(sm.u32(q_row[ln] + 32 * kk + 16 + 4 * t[ln])) for ln in range(32)])
                for mt in range(4):
                    a = ldsm4(sm, tile + mt * 16 * kRowBytes + k_lane + 32 * kk, False)
                    mma(s[mt], a, b0, b1)
            k0 = (first + i) * kKeys
            mx = np.full((32, 2), -np.inf)
            all_prefix = k0 + kKeys <= prefix
            for mt in range(4):
                for c in range(4):
                    v = k0 + 16 * mt + g + 8 * (c >> 1)
                    e = c & 1
                    for ln in range(32):
                        seen = (
                            all_prefix
                            or v[ln] < prefix
                            or (v[ln] < keys and real[ln, e] and p["mask"][b, n_of[ln, e], v[ln] - prefix])
                        )
                        x = s[mt, ln, c] * p["scale_log2"] if seen else -np.inf
                        s[mt, ln, c] = x
                        mx[ln, e] = max(mx[ln, e], x)
            for msk in (4, 8, 16):
                mx = np.maximum(mx, shfl_xor(mx, msk))
            mnew = np.maximum(st["mrun"], mx)
            base_m = np.where(mnew == -np.inf, 0.0, mnew)
            alpha = np.exp2(st["mrun"] - base_m)
            st["mrun"] = mnew
            sm_sum = np.zeros((32, 2))
            pslot = kNarrowSmemP + w * 8 * kPStride
            for mt in range(4):
                for c in range(4):
                    e = c & 1
                    pv = np.exp2(s[mt, :, c] - base_m[:, e])
                    sm_sum[:, e] += pv
                    key = 16 * mt + g + 8 * (c >> 1)
                    for ln in range(32):
                        sm.set_u16(pslot + (2 * t[ln] + e) * kPStride + 2 * key[ln], int(bf16(pv[ln])))
            st["lrun"] = st["lrun"] * alpha + sm_sum
            st["o"] *= alpha[:, None, [0, 1, 0, 1]]
            p_row = kNarrowSmemP + (w * 8 + g) * kPStride
            for ks in range(4):
                b0 = np.array([pair(sm.u32(p_row[ln] + 32 * ks + 4 * t[ln])) for ln in range(32)])
                b1 = np.array([pair(sm.u32(p_row[ln] + 32 * ks + 16 + 4 * t[ln])) for ln in range(32)])
                for dt in range(32):
                    a = ldsm4(sm, tile + ks * 16 * kRowBytes + v_lane + 32 * dt, True)
                    o_dt = st["o"][:, dt, :]
                    mma(o_dt, a, b0, b1)
                    st["o"][:, dt, :] = o_dt
    for w, st in enumerate(warps):
        if not st["active"]:
            continue
        l_ = st["lrun"].copy()
        for msk in (4, 8, 16):
            l_ = l_ + shfl_xor(l_, msk)
        for lane in range(32):
            gg, tt = lane >> 2, lane & 3
            for e in range(2):
                qm = st["wrow"] + 2 * tt + e
                if qm >= p["m"]:
                    continue
                inv = 1 / l_[lane, e] if l_[lane, e] > 0 else 0.0
                row = (b * p["splits"] + split) * p["m"] + qm
                for dt in range(32):
                    p["part"][row, 16 * dt + gg] = st["o"][lane, dt, e] * inv
                    p["part"][row, 16 * dt + gg + 8] = st["o"][lane, dt, 2 + e] * inv
                if gg == 0:
                    p["stats"][row] = (st["mrun"][lane, e], l_[lane, e])


def main(B, N, H, S, splits, lens, seed=0):
    rng = np.random.default_rng(seed)
    M = N * H
    scale = 0.1
    lens = np.array(lens)
    q_lat = bf16(rng.standard_normal((B * M, kRank)))
    q_pe = bf16(rng.standard_normal((B * M, kRope)))
    latent = bf16(rng.standard_normal((B * S, kRank)))
    pe = bf16(rng.standard_normal((B * S, kRope)))
    mask = np.tril(rng.random((B, N, N)) < 0.6) | np.eye(N, dtype=bool)[None]
    if B > 1:
        mask[1, 1, :] = False  # a row that sees nothing of the tree
    p = dict(
        q_lat=q_lat,
        q_pe=q_pe,
        latent=latent,
        pe=pe,
        lens=lens,
        mask=mask,
        n=N,
        h=H,
        s=S,
        m=M,
        splits=splits,
        scale_log2=scale * 1.4426950408889634,
        part=np.full((B * splits * M, kRank), np.nan),
        stats=np.full((B * splits * M, 2), np.nan),
    )
    for b in range(B):
        for split in range(splits):
            for bx in range((M + kNarrowRows - 1) // kNarrowRows):
                run_block(p, bx, split, b, Smem(kNarrowSmem))
    # combine (the CombineKernel's math)
    part = p["part"].reshape(B, splits, M, kRank)
    stats = p["stats"].reshape(B, splits, M, 2)
    top = np.max(np.where(stats[..., 1] > 0, stats[..., 0], -np.inf), axis=1)
    wgt = np.where(stats[..., 1] > 0, stats[..., 1] * np.exp2(stats[..., 0] - top[:, None]), 0)
    tot = wgt.sum(1)
    out = np.einsum("bsm,bsmr->bmr", wgt, np.nan_to_num(part)) / np.where(tot == 0, 1, tot)[..., None]
    # reference
    ql, qp, lat, rp = (f32(x).astype(np.float64) for x in (q_lat, q_pe, latent, pe))
    ref = np.zeros((B, M, kRank))
    for b in range(B):
        L = lens[b]
        for m in range(M):
            n = m // H
            L = min(max(lens[b], 0), S)
            t0 = min(max(lens[b], 0), S - N)
            sc = (lat[b * S : (b + 1) * S] @ ql[b * M + m] + rp[b * S : (b + 1) * S] @ qp[b * M + m]) * scale
            idx = list(range(L)) + [t0 + u for u in range(N) if mask[b, n, u]]
            if not idx:
                continue
            sc2 = sc[idx]
            pr = np.exp(sc2 - sc2.max())
            pr /= pr.sum()
            ref[b, m] = pr @ lat[b * S : (b + 1) * S][idx]
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"B={B} N={N} H={H} S={S} splits={splits} cache_lens={lens.tolist()}: relative error {err:.1e} against "
          f"float64, NaN: {bool(np.isnan(out).any())}")
    return err


if __name__ == "__main__":
    # two row blocks' warps partly padding; an empty cache and a tree clamped at the cache's end (keys seen twice, as
    # BlockKeys maps them), a tree row that sees no tree key; one split (the bf16 output's path); tiles split 4 ways
    errs = [main(1, 3, 4, 150, 2, [127]), main(2, 5, 8, 200, 3, [0, 199]), main(1, 1, 8, 300, 1, [299]),
            main(1, 9, 8, 130, 4, [40])]
    raise SystemExit(0 if max(errs) < 1e-2 else 1)
