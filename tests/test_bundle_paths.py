"""The longest feasible path through a loop iteration (mkdsl/backends/tpu/bundle_paths.py), on small bundle
listings written in libtpu's final-bundles format, and on the committed tiny-kernel dump."""

from mkdsl.backends.tpu import bundle_paths, bundles


def _listing(body: list[str]) -> list[bundles.Bundle]:
    lines = [f"{i:#x}   : > {{ {text} }}" for i, text in enumerate(body)]
    lines[0] = lines[0].replace("   :", " LB:") + " /* Start region 1 */"
    return bundles.parse_bundles("\n".join(lines))


def _path(body: list[str]) -> int:
    found = _listing(body)
    texts = [b.text for b in found]
    last = len(found) - 1
    return bundle_paths.longest_path(texts, 0, last, set(range(last + 1)), bundle_paths.region_starts(texts))


def _arms(first_test: str, second_test: str) -> list[str]:
    """Two regions of 10 bundles, skipped by branches on two compares of the same register."""
    return [
        "%s1 = sld [smem:[#a]]",
        f"%p1 = scmp.{first_test}.s32.totalorder %s1, 5",
        f"%p2 = scmp.{second_test}.s32.totalorder %s1, 5",
        "%3 = sbr.rel (%p1) target = $region7",
        "%4 = snop",
        "%5 = snop",
        *["%6 = sadd.s32 %s1, 1"] * 10,  # the first arm
        "%7 = sbr.rel (%p2) target = $region9 } /* Start/End empty region 7 */ {",
        "%8 = snop",
        "%9 = snop",
        *["%10 = sadd.s32 %s1, 2"] * 10,  # the second arm
        "%11 = snop } /* Start/End empty region 9 */ {",
        "%12 = sbr.rel (%p0) target = $region1",  # the back branch
    ]


def test_exclusive_arms_count_once():
    # p1: s1 >= 5 skips the first arm, p2: s1 < 5 skips the second: one arm per iteration.
    body = _arms("ge", "lt")
    assert len(body) == 31
    # 4 before the first branch, its 2 delay slots (taken) or the 2 slots + 10 (not), the second
    # branch and its slots, then 10 or none, the end: the longest feasible path takes one arm.
    assert _path(body) == 31 - 10


def test_independent_arms_count_both():
    # p1: s1 >= 5 skips the first, p2: s1 >= 5 skips the second: both run when s1 < 5.
    assert _path(_arms("ge", "ge")) == 31


def test_negated_and_unknown_predicates_keep_both_ways():
    body = _arms("ge", "lt")
    body[6] = "%p3 = pneg %p1"  # the first arm's first bundle now defines p3 = !p1
    body[16] = body[16].replace("(%p2)", "(%p3)")  # the second arm is skipped when s1 < 5 as before
    assert _path(body) == 31 - 10
    unknown = [b.replace("(%p2)", "(%p77)") for b in _arms("ge", "lt")]  # p77: defined outside
    assert _path(unknown) == 31


def test_straight_loops_of_the_tiny_dump_keep_their_size():
    import gzip
    from pathlib import Path

    data = Path(__file__).parent / "data" / "static"
    found = bundles.parse_bundles(gzip.decompress((data / "tiny-final_bundles.txt.gz").read_bytes()).decode())
    for t in bundles.time_loops(found, None):
        assert 0 < t.self_bundles <= t.code_bundles and t.self_bundles <= t.bundles
