"""benchmarks/ncu_source_top.py on a hand-written source-page CSV (no GPU, no ncu): kernels split, sums, ranking."""

import gzip
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import ncu_source_top  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb",'
          '"stall_math","stall_barrier","stall_long_sb (Not Issued)"')
CSV = "\n".join([
    '"Kernel Name","void Tile<1>(Params)",',
    HEADER,
    '"0x10","      LDGSTS.E.BYPASS.128 desc[UR6][R12.64], [R67]","10","100","0","2","8","0"',
    '"0x20","      IMAD.IADD R4, R3, 0x1, R195","60","100","55","5","0","40"',
    '"0x30","      @!P1  BRA 0x10","30","100","0","0","30","0"',
    "",
    '"Kernel Name","void Gemm<2>(Params)",',
    HEADER,
    '"0x10","      HMMA.16816.F32.BF16 R4, R8, R12, R4","0","5","0","0","0","0"',
])


def test_kernels_split_and_rows_kept_in_order():
    got = ncu_source_top.kernels(CSV)
    assert [name for name, _ in got] == ["void Tile<1>(Params)", "void Gemm<2>(Params)"]
    assert [r["Address"] for r in got[0][1]] == ["0x10", "0x20", "0x30"]
    assert len(got[1][1]) == 1


def test_opcode_drops_predicate_and_modifiers():
    assert ncu_source_top.opcode("@!P1  BRA 0x10") == "BRA"
    assert ncu_source_top.opcode("LDGSTS.E.BYPASS.128 desc[UR6][R12.64], [R67]") == "LDGSTS"
    assert ncu_source_top.opcode("") == "?"


def test_summary_shares_and_ranking():
    (name, rows), _ = ncu_source_top.kernels(CSV)
    lines = ncu_source_top.summary(name, rows, top=2)
    assert lines[0] == "== void Tile<1>(Params): 3 instructions, 100 samples"
    # reasons over all instructions: long_sb 55, barrier 38, math 7 (the "Not Issued" column is not a reason)
    assert lines[1] == "  by reason: long_sb 55.0%, barrier 38.0%, math 7.0%"
    assert lines[2].startswith("  by opcode: IMAD 60.0%, BRA 30.0%, LDGSTS 10.0%")
    ranked = lines[4:]
    assert len(ranked) == 2
    assert "IMAD.IADD" in ranked[0] and "60.00%" in ranked[0] and "long_sb:55 math:5" in ranked[0]
    assert "BRA 0x10" in ranked[1] and "barrier:30" in ranked[1]


def test_kernel_without_samples_says_so():
    _, (name, rows) = ncu_source_top.kernels(CSV)
    assert ncu_source_top.summary(name, rows, top=5)[1] == "  (no samples)"


def test_main_reads_gzip_and_refuses_other_files(tmp_path, capsys):
    path = tmp_path / "src.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(CSV)
    assert ncu_source_top.main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "void Gemm<2>(Params): 1 instructions, 0 samples" in out
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n1,2\n")
    assert ncu_source_top.main([str(other)]) == 1
    assert "no kernel" in capsys.readouterr().err
    assert ncu_source_top.main([str(tmp_path / "missing.csv")]) == 1
