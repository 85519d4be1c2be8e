"""bench/sass_phases.py on a synthetic ncu source page: phases end at each BAR, instructions are
counted per warp (the first instruction's count is the warp count) and samples as shares."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sass_phases.py")
HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_wait","stall_barrier"')


def test_phases_cut_at_barriers(tmp_path):
    rows = [("LDC R1, c[0x0][0x28]", 10, 8, 2, 0),       # 8 warps
            ("IMAD R2, R3, R4, RZ", 30, 24, 6, 0),
            ("BAR.SYNC.DEFER_BLOCKING 0x0", 20, 8, 0, 20),
            ("@P0 HMMA.16816.F32.BF16 R4, R8, R12, R4", 40, 32, 9, 0)]
    lines = ["==PROF== noise", HEADER]
    lines += [f'"0x{i:x}","      {src}","{s}","0","{n}","{w}","{b}"' for i, (src, s, n, w, b) in enumerate(rows)]
    path = tmp_path / "page.csv"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, SCRIPT, str(path)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "8 warps, 9 instructions per warp, 100 samples"
    assert lines[1].startswith("[    0-    2]      5/warp  60.0% samples | ")
    assert "IMAD:3" in lines[1] and "BAR:1" in lines[1] and "barrier:20" in lines[1]
    assert lines[2].startswith("[    3-    3]      4/warp  40.0% samples | HMMA:4")
    listing = subprocess.run([sys.executable, SCRIPT, str(path), "--lines", "1", "1"], capture_output=True,
                             text=True, check=True).stdout
    assert listing.split()[:3] == ["1", "3.00", "30"]
