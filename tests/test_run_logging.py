"""The run logger's own behaviour: the line a run prints when it is learning nothing."""

from utils import tracking


def logged_warnings(tmp_path, capsys, zero_var_fracs):
    logger = tracking.RunLogger(tmp_path, {}, len(zero_var_fracs), "test", quiet=True)
    for step, fraction in enumerate(zero_var_fracs, 1):
        logger.log(step, zero_var_frac=fraction)
    logger.finish({})
    return [line for line in capsys.readouterr().err.splitlines() if "learning nothing" in line]


def test_a_run_whose_groups_stay_flat_says_so_once(tmp_path, capsys):
    """Three steps in a row with every group flat: one warning, even in a quiet run; a flat
    streak broken by one varied group starts again."""
    assert len(logged_warnings(tmp_path / "flat", capsys, [1.0] * 6)) == 1
    assert logged_warnings(tmp_path / "broken", capsys, [1.0, 1.0, 0.5, 1.0, 1.0]) == []
    assert len(logged_warnings(tmp_path / "twice", capsys, [1.0] * 3 + [0.9] + [1.0] * 3)) == 2
    assert logged_warnings(tmp_path / "learning", capsys, [0.75, 0.5, 0.25, 0.0]) == []
