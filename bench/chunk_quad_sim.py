"""The chunked kernel's quad solve (src/cuda/vk_chunk.cuh, P1..P3 in registers): its index map
(P1 columns, accumulator lanes, owners) against the thread-per-row solve, float64, T = 1..16;
every (row, token) covered once. Prints max error 0 when the operations and their order match,
and exits 1 otherwise. python3 bench/chunk_quad_sim.py
"""
import sys

# Emulates the kernel's P1 column map, accumulator extraction and quad solve against the
# thread-per-row solve (float64), for T = 1..16, one m-tile (16 rows).
import numpy as np
rng = np.random.default_rng(3)
KM = 16
bad = False
for T in range(1, 17):
    TP = 8 if T <= 8 else 16
    NJ = TP // 4
    R = 16
    Sq = rng.normal(size=(R, T)); Sk = rng.normal(size=(R, T)); v = rng.normal(size=(T, R))
    ga = rng.normal(size=KM); gc = rng.normal(size=KM); gw = rng.normal(size=KM); beta = rng.normal(size=KM)
    Akk = rng.normal(size=(KM, KM)); Aqk = rng.normal(size=(KM, KM))
    # reference: thread per row
    dref = np.zeros((R, T)); oref = np.zeros((R, T))
    for r in range(R):
        d = np.zeros(T)
        for t in range(T):
            x = -ga[t] * Sk[r, t] + v[t, r]
            for s in range(t): x = -Akk[t, s] * d[s] + x
            d[t] = beta[t] * x
            o = gc[t] * Sq[r, t]
            for s in range(t + 1): o = Aqk[t, s] * d[s] + o
            oref[r, t] = o
        dref[r] = d
    wref = dref * gw[:T]
    # P1 product columns through p1_col: column col -> q_t (col < TP) or k_t (col >= TP)
    def prod(r, col):
        t = col if col < TP else col - TP
        if t >= T: return 0.0
        return Sq[r, t] if col < TP else Sk[r, t]
    npc = TP // 8
    acc = {}  # (lane, np, h, i)
    for lane in range(32):
        g, t4 = lane >> 2, lane & 3
        for np_ in range(2):
            for h in range(2):
                for i in range(4):
                    col = np_ * 16 + h * 8 + 2 * t4 + (i & 1)
                    acc[lane, np_, h, i] = prod(g + 8 * (i >> 1), col) if np_ < npc else np.nan
    # per lane state
    st = {}
    for lane in range(32):
        g, t4 = lane >> 2, lane & 3
        tj = [8 * (j >> 1) + 2 * t4 + (j & 1) for j in range(NJ)]
        x = np.zeros((2, NJ)); o = np.zeros((2, NJ)); d = np.zeros((2, NJ))
        for e in range(2):
            r = g + 8 * e
            for j in range(NJ):
                c = acc[lane, j >> 2, (j >> 1) & 1, 2 * e + (j & 1)]
                a = acc[lane, TP // 16 + (j >> 2), (TP // 8 + (j >> 1)) & 1, 2 * e + (j & 1)]
                if tj[j] < T:
                    x[e, j] = -ga[tj[j]] * a + v[tj[j], r]
                    o[e, j] = gc[tj[j]] * c
        st[lane] = dict(tj=tj, x=x, o=o, d=d)
    for t in range(TP):
        if t >= T: break
        jo = ((t >> 3) << 1) | (t & 1); owner = (t & 7) >> 1
        cand = {lane: [beta[t] * st[lane]['x'][e, jo] for e in range(2)] for lane in range(32)}
        for lane in range(32):
            s_ = st[lane]; t4 = lane & 3
            dt = cand[(lane & ~3) | owner]
            if t4 == owner: s_['d'][0, jo], s_['d'][1, jo] = dt
            for j in range(NJ):
                tjj = s_['tj'][j]
                if tjj >= T or tjj < t: continue
                if tjj > t:
                    for e in range(2): s_['x'][e, j] = -Akk[tjj, t] * dt[e] + s_['x'][e, j]
                for e in range(2): s_['o'][e, j] = Aqk[tjj, t] * dt[e] + s_['o'][e, j]
    # compare
    err = 0
    for lane in range(32):
        g, t4 = lane >> 2, lane & 3; s_ = st[lane]
        for e in range(2):
            r = g + 8 * e
            for j in range(NJ):
                tjj = s_['tj'][j]
                if tjj < T:
                    err = max(err, abs(s_['o'][e, j] - oref[r, tjj]), abs(gw[tjj] * s_['d'][e, j] - wref[r, tjj]))
    # every (row, token) covered exactly once per quad
    cover = np.zeros((R, T), int)
    for lane in range(32):
        g = lane >> 2
        for e in range(2):
            for tjj in st[lane]['tj']:
                if tjj < T: cover[g + 8 * e, tjj] += 1
    print(T, TP, f"max err {err:.2e}", "coverage ok" if (cover == 1).all() else f"coverage BAD {cover.min()} {cover.max()}")
    bad |= err != 0 or not (cover == 1).all()
sys.exit(1 if bad else 0)
