"""The run logger's own behaviour: the line a run prints when its reward teaches it nothing; and
the loops' measurement seams, the step's loss statistics and its phase seconds."""

import torch

from utils import tracking


def logged_warnings(tmp_path, capsys, zero_var_fracs):
    logger = tracking.RunLogger(tmp_path, {}, len(zero_var_fracs), "test", quiet=True)
    for step, fraction in enumerate(zero_var_fracs, 1):
        logger.log(step, zero_var_frac=fraction)
    logger.finish({})
    return [
        line for line in capsys.readouterr().err.splitlines() if "teaching this run nothing" in line
    ]


def test_a_run_whose_groups_stay_flat_says_so_once(tmp_path, capsys):
    """Three steps in a row with every group flat: one warning, even in a quiet run, and only one
    per run; a flat streak broken by one varied group starts again."""
    assert len(logged_warnings(tmp_path / "flat", capsys, [1.0] * 6)) == 1
    assert logged_warnings(tmp_path / "broken", capsys, [1.0, 1.0, 0.5, 1.0, 1.0]) == []
    assert len(logged_warnings(tmp_path / "twice", capsys, [1.0] * 3 + [0.9] + [1.0] * 3)) == 1
    assert logged_warnings(tmp_path / "learning", capsys, [0.75, 0.5, 0.25, 0.0]) == []


def test_step_metrics_sum_the_loss_and_weigh_statistics_by_rows():
    """Two updates: the loss is their mean, |ρ − 1| the largest (the first update's apart), and a
    statistic is a mean over rows whether it comes per row (a tensor) or per micro-batch."""
    metrics = tracking.StepMetrics(num_updates=2)
    metrics.add(3, 1.0, 0.5, update=0, w=torch.tensor([1.0, 2.0, 3.0]), clipfrac=0.5)
    metrics.add(1, 3.0, 0.75, update=1, w=torch.tensor([6.0]), clipfrac=1.0)
    assert metrics.means() == {
        "loss": 2.0,
        "ratio_dev": 0.75,
        "ratio_dev_first": 0.5,
        "w": 3.0,
        "clipfrac": 0.625,
    }
    assert "ratio_dev_first" not in tracking.StepMetrics().means()  # one update: not asked


def test_phases_report_each_phase_once_and_start_again():
    phases = tracking.Phases()
    with phases.time("rollout"):
        pass
    with phases.time("update"):
        pass
    seconds = phases.seconds()
    assert list(seconds) == ["time_rollout", "time_update"] and min(seconds.values()) >= 0
    assert phases.seconds() == {}
