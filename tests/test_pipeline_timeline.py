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
    assert len(err) == 2 and "no timeline" in err[0] and "multiple of p=4" in err[1]
