"""Timelines drawn from a schedule alone (predictions) and the command's errors."""

import pytest

from shardwise.cli import timeline as timeline_cli
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.bubble import ideal_bubble


@pytest.mark.parametrize("kind, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("pipedream", 1)])
def test_predicted_idle_fraction_is_the_textbook_bubble(kind, v):
    for p, m in ((2, 2), (2, 4), (4, 8)):
        events = timeline.predicted(kind, p, m, v)
        assert timeline.idle_fraction(events) == pytest.approx(ideal_bubble(kind, p, m, v))


def test_render_prediction_and_errors(tmp_path, capsys):
    out = tmp_path / "pred.png"
    assert timeline_cli.main(["--predict", "1f1b", "--pp", "4", "--micro-batches", "8",
                              "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline_cli.main([str(tmp_path / "nothing")]) == 2
    assert timeline_cli.main(["--predict", "interleaved", "--pp", "4", "--micro-batches", "6",
                              "--chunks-per-rank", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no timeline" in err[0] and "multiple of parallel.pp=4" in err[1]


def _has_colour(png, colour) -> bool:
    """Whether PNG ``png`` has a pixel of exactly ``colour`` (a matplotlib colour)."""
    import numpy as np
    from matplotlib import colors, image

    px = (image.imread(png)[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    rgb = np.array([round(c * 255) for c in colors.to_rgb(colour)], dtype=np.uint8)
    return bool((px == rgb).all(axis=1).any())


@pytest.mark.parametrize("kind, v", [("zb1p", 1), ("zbv", 2)])
def test_split_backward_timeline_draws_f_b_w_in_three_colours(kind, v, tmp_path):
    """A zero-bubble prediction: each rank's rows hold F, B and W boxes, drawn in the three
    colours of ``timeline.SPLIT_COLOURS`` (fused timelines keep colours by micro-batch)."""
    events = timeline.predicted(kind, 4, 8, v)
    assert {e["kind"] for e in events} == {"Forward", "BackwardInput", "BackwardWeight"}
    assert {e["rank"] for e in events} == set(range(4))
    out = timeline.render(events, tmp_path / "zb.png", kind)
    for name, colour in timeline.SPLIT_COLOURS.items():
        assert _has_colour(out, colour), name
    assert not _has_colour(out, timeline.FUSED_COLOUR)
    fused = timeline.render(timeline.predicted("1f1b", 4, 8), tmp_path / "f.png", "1f1b")
    assert not any(_has_colour(fused, c) for c in timeline.SPLIT_COLOURS.values())


def test_dualpipev_timeline_draws_its_fused_backwards_in_a_fourth_colour(tmp_path):
    """DualPipeV fuses the steady state's backwards and splits the rest: F, B, W and the
    fused ones (``timeline.FUSED_COLOUR``) on every rank's rows."""
    events = timeline.predicted("dualpipev", 4, 8, 2)
    assert {e["kind"] for e in events} == {"Forward", "Backward", "BackwardInput",
                                           "BackwardWeight"}
    out = timeline.render(events, tmp_path / "dpv.png", "dualpipev")
    for colour in (*timeline.SPLIT_COLOURS.values(), timeline.FUSED_COLOUR):
        assert _has_colour(out, colour), colour
