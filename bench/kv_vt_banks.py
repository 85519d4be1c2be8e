"""Shared-memory wavefronts of decode_kv_vt_kernel's tile accesses, by simulation (no GPU).

For each warp-wide access of the kernel (src/cuda/vk.cuh) the script lists the bytes each lane
touches and counts the wavefronts as the most distinct 4-byte words that fall on one of the 32
banks (a word read by several lanes is one broadcast). Two tile layouts:
  main  KvVtTile on main: rows k of RT elements, 16-byte pieces swizzled by kp = k / VE over
        min(RT / VE, 8) pieces;
  tma   exp/kv-vt-tma's: panels of 128 bytes, row k = kp * VE + e stored as e * KP + kp, pieces
        XORed by the row's 128-byte line (the TMA unit's 32/64/128-byte swizzle).
Accesses: the token loop's reads (and its stores into the tile, the same addresses), and the
copy-in's 16-byte pieces (the store pass reads the same). docs/design.md, "The KV tile by the
TMA unit", quotes the result.

    python3 bench/kv_vt_banks.py
"""

K, E = 128, 16   # head dim; K-elements per lane (VkShape)
L = K // E       # lanes per row
G = 128 // L     # row groups per block of 128 threads


def wavefronts(addrs, width):
    banks = {}
    for a in addrs:
        for w in range(a // 4, (a + width) // 4):
            banks.setdefault(w % 32, set()).add(w)
    return max(len(s) for s in banks.values())


def addr_main(kp, e, r, ve, rt, size):
    mask = min(rt // ve, 8) - 1
    return ((kp * ve + e) * rt + ((r // ve) ^ (kp & mask)) * ve + r % ve) * size


def addr_tma(kp, e, r, ve, rt, size):
    kpn = K // ve
    pw = min(rt, 128 // size)
    lw = pw.bit_length() - 1
    pieces_log = lw - (ve.bit_length() - 1)
    mask, shift = (1 << pieces_log) - 1, 3 - pieces_log
    c = r & (pw - 1)
    return ((((r >> lw) * K + e * kpn + kp) << lw) + ((c // ve) ^ ((kp >> shift) & mask)) * ve + c % ve) * size


def token_loop(addr, size, rr, rt):
    """Mean wavefronts of one (v, e) access: lane (group, j) reads columns lr.. of k = (v L + j) VE + e."""
    ve = 16 // size
    counts = []
    for i in range(rt // (G * rr)):
        for v in range(E // ve):
            for e in range(ve):
                lanes = [addr(v * L + ln % L, e, (i * G + ln // L) * rr, ve, rt, size) for ln in range(32)]
                counts.append(wavefronts(lanes, rr * size))
    return sum(counts) / len(counts)


def copy_in(addr, size, rt):
    """Mean wavefronts of one warp's 16-byte pieces, piece i = (k = i / PRk, c = i % PRk)."""
    ve = 16 // size
    prk = rt // ve
    counts = []
    for w0 in range(0, K * prk, 32):
        lanes = [addr((i // prk) // ve, (i // prk) % ve, (i % prk) * ve, ve, rt, size)
                 for i in range(w0, min(w0 + 32, K * prk))]
        counts.append(wavefronts(lanes, 16))
    return sum(counts) / len(counts)


def main():
    print("access     state  RR  RT  ideal  main   tma")
    for size, name in ((4, "fp32"), (2, "bf16")):
        for rr in (1, 2, 4):
            for rt in (32, 64, 128):
                if rt % (G * rr):
                    continue
                ideal = max(1, 32 * rr * size // 128)
                print(f"token loop {name}  {rr:2d} {rt:3d}  {ideal:5d}  {token_loop(addr_main, size, rr, rt):4.2f}"
                      f"  {token_loop(addr_tma, size, rr, rt):4.2f}")
        for rt in (32, 64, 128):
            print(f"copy-in    {name}   - {rt:3d}      4  {copy_in(addr_main, size, rt):4.2f}"
                  f"  {copy_in(addr_tma, size, rt):4.2f}")


if __name__ == "__main__":
    main()
