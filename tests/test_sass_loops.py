"""benchmarks/sass_loops.py on a hand-written SASS listing (no GPU, no cuobjdump): the loops it finds and counts."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import sass_loops  # noqa: E402

LISTING = """
        Function : _Z4tilev
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
                                                                           /* 0x000fe40000000f00 */
        /*0010*/                   LOP3.LUT R2, R3, 0xf000f, R4, 0xea, !PT ;  /* 0x000f000f03027812 */
                                                                           /* 0x000fe400078eea04 */
        /*0020*/                   HGMMA.64x32x16.F32.BF16 R24, R64, gdesc[UR8], R24, gsb0 ;  /* 0x0 */
                                                                           /* 0x0 */
        /*0030*/              @!P0 BRA 0x10 ;                              /* 0x0 */
                                                                           /* 0x0 */
        /*0040*/                   IADD3 R5, R5, 0x1, RZ ;                 /* 0x0 */
                                                                           /* 0x0 */
        /*0050*/               @P1 BRA 0x40 ;                              /* 0x0 */
                                                                           /* 0x0 */
        /*0060*/                   EXIT ;                                  /* 0x0 */
                                                                           /* 0x0 */
        Function : _Z5outerv
        /*0000*/                   MOV R1, R2 ;                            /* 0x0 */
                                                                           /* 0x0 */
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0 */
                                                                           /* 0x0 */
        /*0020*/               @P0 BRA 0x10 ;                              /* 0x0 */
                                                                           /* 0x0 */
        /*0030*/                   STG.E [R2.64], R4 ;                     /* 0x0 */
                                                                           /* 0x0 */
        /*0040*/               @P1 BRA 0x0 ;                               /* 0x0 */
                                                                           /* 0x0 */
        Function : _Z5otherv
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0 */
                                                                           /* 0x0 */
        /*0010*/                   BRA 0x0 ;                               /* 0x0 */
                                                                           /* 0x0 */
"""


def test_loops_with_an_mma_are_found_and_counted():
    funcs = sass_loops.functions(LISTING)
    assert sorted(funcs) == ["_Z4tilev", "_Z5otherv", "_Z5outerv"] and len(funcs["_Z4tilev"]) == 7
    assert sass_loops.opcode("@!P3 LDGSTS.E.BYPASS.128 [R9], desc[UR6][R6.64]") == "LDGSTS"
    assert sass_loops.loops(funcs["_Z4tilev"]) == [(1, 3)]  # 0x10..0x30; the loop at 0x40 holds no MMA
    lines = sass_loops.report(LISTING, "tile")
    assert len(lines) == 1 and "loop 0x10-0x30: 3 instructions, 1 MMA;" in lines[0]
    assert "LOP3 1, HGMMA 1, BRA 1" in lines[0]
    assert sass_loops.loops(funcs["_Z5outerv"]) == [(1, 2)]  # the outer loop holds no MMA of its own: not counted
    assert len(sass_loops.report(LISTING, ".")) == 3  # every function: the HMMA loops of the other two too


def test_sizes_count_every_instruction_of_each_kernel_longest_first():
    rows = sass_loops.sizes(LISTING, ".")
    named = {k: sass_loops.short_name(v) for k, v in  # 'tile' where c++filt is installed
             sass_loops.demangled(["_Z4tilev", "_Z5outerv", "_Z5otherv"]).items()}
    assert [(name, n) for name, _, n in rows] == [(named["_Z4tilev"], 7), (named["_Z5outerv"], 5),
                                                  (named["_Z5otherv"], 2)]
    assert sass_loops.sizes(LISTING, "outer")[0][2] == 5
    table = sass_loops.size_table(rows)
    assert table[2] == f"| `{named['_Z4tilev']}` | - | 7 | 0.1 |" and len(table) == 5
    name = "_ZN46_GLOBAL__N__58d1f4d1_13_marlin_moe_cu_2adc765010GemmKernelILi4EEEvv"
    assert sass_loops.source_file(name) == "marlin_moe.cu" and sass_loops.source_file("_Z4tilev") == "-"
    assert sass_loops.short_name("void kdtree::(anonymous namespace)::RouteKernel<12>(float const*, int)") == \
        "RouteKernel<12>"
