"""benchmarks/sass_decode.py without compiling: its loop finder and the variants it lists."""

from __future__ import annotations

from benchmarks import sass_decode as sd
from benchmarks import tune_decode as td

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR8][R4.64] ;
        /*0020*/                   HMMA.16816.F32 R8, R12, R16, RZ ;
        /*0030*/                   LDS.U8 R5, [R6+0x10] ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   F2FP.F16.E4M3.UNPACK_B R2, R3 ;
        /*0060*/                   HMMA.16816.F32 R8, R12, R16, RZ ;
        /*0070*/               @P1 BRA 0x50 ;
        /*0080*/                   FADD R1, R2, R3 ;
        /*0090*/                   BRA 0x0 ;
        /*00a0*/                   EXIT ;
"""


def test_inner_loop_is_the_shortest_backward_branch_with_an_mma():
    assert sd.inner_loop(SASS) == ["F2FP.F16.E4M3.UNPACK_B", "HMMA.16816.F32", "BRA"]
    assert sd.inner_loop(SASS.replace("HMMA", "FMUL")) == []


def test_variants_cover_the_tuning_sweep():
    labels = [label for label, _ in sd.variants(fp8=True)]
    assert labels[:2] == ["bf16 KV", "fp8 default"] and len(labels) == 2 + len(td.FP8_VARIANTS)
    assert "fp8 q/none" in labels  # the kernel before the FP8 options, always timed
    assert sd.variants(fp8=False) == [("bf16 KV", {})]
