"""Document-length histograms published with public long-context attention benchmarks.

They become the length distributions ``pile``, ``prolong512k`` and ``magi_long`` of
:mod:`.distributions` (a length uniform inside a bin drawn by its share of the samples), so the
planner and the simulator can be read on data someone else measured, beside the synthetic
shapes fitted to the paper's anchors.  Each table is ``(first, last, samples)``: the lengths
``first..last`` (both included) and how many documents (or what share of them) fall there.

Sources (the published numbers; nothing else taken from those repositories):

* ``pile`` and ``prolong512k``: LongCA-bench (github.com/NJUDeepEngine/LongCA-bench),
  ``longca_bench/dist_attn/distribution/pile.csv`` and ``prolong512k.csv`` at commit
  ``5d83d89a54869e42b63c95c60f955d330bb707b0``: document counts per token-length bin of the
  Pile (153M documents, up to 9.3M tokens) and of ProLong's 512K training mix (20M documents,
  up to 476K tokens).  Where two bins of the CSVs share an edge (196608, 393216, 524288), the
  upper one starts one token later here.
* ``magi_long``: MagiAttention (github.com/SandAI-org/MagiAttention),
  ``exps/dist_attn/benchmark/utils.py`` at commit ``20f1a43695e28da45396b29c7246f810b3391105``,
  ``varlen_long_seqlen_distribution``: the share of documents per bin (up to 4M tokens) its
  distributed-attention benchmark packs into sequences longer than 64K (the shares add up to
  1.31 there; they are normalised when sampled).
"""

from __future__ import annotations

K = 1024

PILE = (
    (0, 10, 1103032),
    (11, 50, 9192701),
    (51, 100, 15691267),
    (101, 200, 33759245),
    (201, 500, 49972885),
    (501, 1024, 19843834),
    (1025, 2048, 11070542),
    (2049, 4096, 6568231),
    (4097, 8192, 4588038),
    (8193, 12288, 1029929),
    (12289, 16384, 289899),
    (16385, 24576, 159160),
    (24577, 32768, 45191),
    (32769, 49152, 33943),
    (49153, 65536, 17976),
    (65537, 131072, 30466),
    (131073, 196608, 7054),
    (196609, 393216, 2992),
    (393217, 524288, 266),
    (524289, 9323147, 422),
)

PROLONG_512K = (
    (0, 10, 12527),
    (11, 50, 511697),
    (51, 100, 1800359),
    (101, 200, 3756513),
    (201, 500, 6876068),
    (501, 1024, 4519766),
    (1025, 2048, 1849207),
    (2049, 4096, 603531),
    (4097, 8192, 210114),
    (8193, 12288, 48472),
    (12289, 16384, 18762),
    (16385, 24576, 33780),
    (24577, 32768, 18271),
    (32769, 49152, 32477),
    (49153, 65536, 34829),
    (65537, 131072, 1219),
    (131073, 196608, 2960),
    (196609, 393216, 5292),
    (393217, 475862, 842),
)

MAGI_LONG = (
    (0, 2 * K, 0.16),
    (2 * K, 4 * K, 0.05),
    (4 * K, 8 * K, 0.04),
    (8 * K, 16 * K, 0.06),
    (16 * K, 32 * K, 0.08),
    (32 * K, 64 * K, 0.21),
    (64 * K, 128 * K, 0.4),
    (128 * K, 256 * K, 0.2),
    (256 * K, 512 * K, 0.05),
    (512 * K, 1024 * K, 0.04),
    (1024 * K, 2048 * K, 0.01),
    (2048 * K, 4096 * K, 0.01),
)

#: Distribution name -> its histogram, with where it comes from.
HISTOGRAMS: dict[str, tuple[tuple[int, int, float], ...]] = {
    "pile": PILE,
    "prolong512k": PROLONG_512K,
    "magi_long": MAGI_LONG,
}

SOURCES: dict[str, str] = {
    "pile": "NJUDeepEngine/LongCA-bench@5d83d89a54869e42b63c95c60f955d330bb707b0:"
    "longca_bench/dist_attn/distribution/pile.csv",
    "prolong512k": "NJUDeepEngine/LongCA-bench@5d83d89a54869e42b63c95c60f955d330bb707b0:"
    "longca_bench/dist_attn/distribution/prolong512k.csv",
    "magi_long": "SandAI-org/MagiAttention@20f1a43695e28da45396b29c7246f810b3391105:"
    "exps/dist_attn/benchmark/utils.py (varlen_long_seqlen_distribution)",
}
