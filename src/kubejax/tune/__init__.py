"""Hyperparameter sweeps: an Optuna study whose trials are jobs running in parallel.

    result = tune(SweepConfig(space={"learning_rate": {"type": "float", "low": 1e-5,
                                                       "high": 1e-3, "log": True}}),
                  trial_spec=my_spec_factory, trials_root="trials")

`space` validates a search space and maps it onto Optuna, `controller` runs the study,
`report` writes what it found. Trials that run the kubejax trainer are built by
`kubejax.launchers.sweep`.
"""

from kubejax.tune.controller import SweepConfig, SweepResult, TrialSpecFactory, tune
from kubejax.tune.report import write_report, write_trials
from kubejax.tune.space import ALGORITHMS, PRUNERS, SweepError, parse_space

__all__ = [
    "ALGORITHMS",
    "PRUNERS",
    "SweepConfig",
    "SweepError",
    "SweepResult",
    "TrialSpecFactory",
    "parse_space",
    "tune",
    "write_report",
    "write_trials",
]
