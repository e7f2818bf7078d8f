"""`mkdsl verify`'s default rows cross the spec's smallest attention window (fast: no kernel run)."""

from __future__ import annotations

from pathlib import Path


def test_verify_starts_rows_where_the_steps_cross_the_smallest_window():
    """Gemma 3's mini profile: local layers with a 32-token window; row 0 starts at 31, so its
    second step is the first to drop a token; a spec without a window keeps row b at 3b."""
    from mkdsl.lang.elaborate import elaborate
    from mkdsl.lang.syntax import parse
    from mkdsl.verify import kernel as verify

    root = Path(__file__).resolve().parent.parent
    text = (root / "specs" / "gemma3_27b.mk").read_text(encoding="utf-8")
    model = elaborate(parse(text), "mini", text)
    window, line = verify.smallest_window(model)
    assert window == 32 and "= attention(" in text.splitlines()[line - 1], (window, line)
    positions, note = verify.start_positions(model, 2, 2, 512)
    assert positions.tolist() == [31, 34] and "cross the smallest window or chunk (32 tokens" in note, (positions, note)
    tiny = (root / "specs" / "tiny.mk").read_text(encoding="utf-8")
    positions, note = verify.start_positions(elaborate(parse(tiny), None, tiny), 3, 2, 64)
    assert positions.tolist() == [0, 3, 6] and note == ""
