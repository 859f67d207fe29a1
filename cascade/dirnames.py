"""Job directory names for Hydra sweeps: ``conf/config.yaml``'s ``hydra.sweep.subdir`` is
``${hydra.job.num}_${job_dirname:${hydra.job.override_dirname}}``; importing this module
registers the ``job_dirname`` resolver (``cascade.run`` and ``cascade.sweep`` do)."""

from __future__ import annotations

import hashlib

from omegaconf import OmegaConf

DIRNAME_CHARS = 120  # a job directory's name from its overrides, at most (a file system allows 255 bytes)
DIGEST_CHARS = 10  # of the overrides' sha1, after "_", where the name is cut


def job_dirname(overrides: str) -> str:
    """A job directory's name from Hydra's ``override_dirname``: itself when short, else its first
    characters and a hash of the whole (a sweep over many ``~methods.X`` removals named a
    directory past the file system's 255-byte limit and every job failed on it). The same
    overrides give the same name, so ``resume=true`` finds the directory again."""
    if len(overrides.encode()) <= DIRNAME_CHARS:
        return overrides
    digest = hashlib.sha1(overrides.encode()).hexdigest()[:DIGEST_CHARS]
    return overrides.encode()[: DIRNAME_CHARS - 1 - DIGEST_CHARS].decode(errors="ignore") + "_" + digest


if not OmegaConf.has_resolver("job_dirname"):
    OmegaConf.register_new_resolver("job_dirname", job_dirname)  # conf/config.yaml's hydra.sweep.subdir
