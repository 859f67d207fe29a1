"""Resumable Hydra sweeps, with any launcher (basic, joblib, submitit local or SLURM).

``ResumableSweeper`` is Hydra's basic sweeper (same override grammar, same job numbering and
directories) with two additions, selected in ``conf/hydra/sweeper/resumable.yaml``:

* after each batch it lists the jobs whose directory holds no ``summary.json`` (killed,
  preempted, timed out or crashed: ``run`` writes the summary last and atomically, so its
  presence marks a complete job), and says how to resume;
* with ``resume=true`` on the same command line it launches only those jobs, with their original
  job numbers, so they write into their original directories; complete jobs are not launched and
  their directories are not touched. When the command's ``hydra.sweep.dir`` does not exist (the
  default directory holds a timestamp), the newest earlier sweep of the same experiment whose
  overrides equal this command's is resumed.

Incomplete jobs are launched in runs of consecutive job numbers, one launcher call per run (a
launcher numbers the jobs of one call consecutively); runs within a call proceed in parallel as
the launcher allows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from cascade import dirnames  # noqa: F401  (registers the job_dirname resolver hydra.sweep.subdir uses)

log = logging.getLogger(__name__)

SUMMARY = "summary.json"  # written last by cascade.run.run: present = complete


def _task_overrides(config: DictConfig) -> list[str]:
    return [o for o in config.hydra.overrides.task if o.split("=", 1)[0].lstrip("+~") != "resume"]


def _find_sweep_to_resume(config: DictConfig) -> Path | None:
    """The newest sweep next to the configured directory that was started with the same task
    overrides (the default sweep directory holds a timestamp, so a re-run names a new one)."""
    here = Path(str(config.hydra.sweep.dir))
    if here.is_dir():
        return here
    want = sorted(_task_overrides(config))
    for candidate in sorted(here.parent.glob("*/multirun.yaml"), reverse=True):
        saved = OmegaConf.load(candidate)
        if sorted(_task_overrides(saved)) == want:
            return candidate.parent
    return None


class _SkipComplete(Launcher):
    """Wraps the configured launcher: launches only the incomplete jobs (when resuming) and
    reports the incomplete jobs after each batch."""

    def __init__(self, inner: Launcher, hydra_context: HydraContext, config: DictConfig, resume: bool) -> None:
        self.inner, self.hydra_context, self.config, self.resume = inner, hydra_context, config, resume

    def setup(self, **kwargs: Any) -> None:  # the inner launcher is set up already
        pass

    def _job_dir(self, overrides: Sequence[str], num: int) -> Path:
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
        return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        dirs = [self._job_dir(o, initial_job_idx + i) for i, o in enumerate(job_overrides)]
        todo = [i for i, d in enumerate(dirs) if not (self.resume and (d / SUMMARY).is_file())]
        for i in sorted(set(range(len(dirs))) - set(todo)):
            log.info("resume: job #%d is complete, not launched: %s", initial_job_idx + i, dirs[i])
        returns: dict[int, JobReturn] = {}
        try:
            for run in _consecutive(todo):
                results = self.inner.launch([job_overrides[i] for i in run], initial_job_idx=initial_job_idx + run[0])
                returns.update(zip(run, results))
        finally:
            missing = [d for d in dirs if not (d / SUMMARY).is_file()]
            if missing:
                log.error("%d of %d jobs are incomplete (no %s): %s -- rerun the same command with resume=true "
                          "to launch only these", len(missing), len(dirs), SUMMARY, ", ".join(map(str, missing)))
        done = JobReturn(status=JobStatus.COMPLETED, _return_value=None)
        return [returns.get(i, done) for i in range(len(dirs))]


def _consecutive(indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class ResumableSweeper(BasicSweeper):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        resume = bool(OmegaConf.select(config, "resume", default=False))
        if resume:
            found = _find_sweep_to_resume(config)
            if found is None:
                raise FileNotFoundError(
                    f"resume=true: no sweep at {config.hydra.sweep.dir} and no earlier sweep in "
                    f"{Path(str(config.hydra.sweep.dir)).parent} with these overrides; pass hydra.sweep.dir=<the sweep>"
                )
            # every job's config is recomposed from these overrides: point them all at that sweep
            with open_dict(config):
                config.hydra.overrides.hydra.append(f"hydra.sweep.dir='{found}'")
                config.hydra.sweep.dir = str(found)
            log.info("resume: sweep %s", found)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher = _SkipComplete(self.launcher, hydra_context, config, resume)
