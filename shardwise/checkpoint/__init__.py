"""Layout-free checkpoints: any layout saves, any other resumes.

* :mod:`~shardwise.checkpoint.store`: save, load, verify and export a checkpoint
  directory (torch.distributed.checkpoint underneath, loaded only when used);
* :mod:`~shardwise.checkpoint.resume`: what a checkpoint records about its run, and the checks of a resume;
* :mod:`~shardwise.checkpoint.held`: what one rank holds of each tensor;
* :mod:`~shardwise.checkpoint.pieces`: those holdings as the rectangles DCP writes and reads;
* :mod:`~shardwise.checkpoint.tools`: ``shardwise checkpoint ls`` and ``export``, as functions returning data.
"""
from shardwise.checkpoint.resume import check_directory, check_resume, run_info
from shardwise.checkpoint.store import (
    FORMAT,
    MANIFEST,
    Restored,
    check_compatible,
    checkpoints,
    current_manifest,
    export,
    latest_valid,
    load,
    materialize,
    model_shapes,
    read_manifest,
    resume_point,
    save,
    tied_aliases,
    verify,
)

# ``shardwise.checkpoint.save(...)`` and the rest, as when the package was one module (store.py and resume.py).
__all__ = ["FORMAT", "MANIFEST", "Restored", "check_compatible", "check_directory", "check_resume", "checkpoints",
           "current_manifest", "export", "latest_valid", "load", "materialize", "model_shapes", "read_manifest",
           "resume_point", "run_info", "save", "tied_aliases", "verify"]
