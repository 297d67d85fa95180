"""Run folders: one folder per run, named injectively from the run name, never shared by accident.

Distinct run names give distinct folders (:func:`folder_name` escapes every character outside
``A-Z a-z 0-9 _ . -`` and cuts long names with a hash of the whole name), and a new run never
writes into a folder that already holds a store of the same worker unless asked to, as in
``wandb.init(resume=...)``:

- ``"never"`` (default): an existing run is an error that names the option; a run whose name was
  *derived* (the active tracker's run, or the time) takes the next free ``-2``, ``-3`` … instead,
  so two hooks in one W&B run get two stores;
- ``"allow"``: continue an existing run, or start a new one;
- ``"must"``: continue an existing run; an error if there is none.

The store file is claimed atomically (``O_CREAT | O_EXCL``), so two processes that pick the same
folder at the same moment cannot both start a new run in it.
"""

from __future__ import annotations

import hashlib
import os
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

from tensorlens._checks import expected

DEFAULT_RUNS_DIR = "tensorlens_runs"
RESUME_POLICIES = ("never", "allow", "must")
#: Folder names longer than this are cut and end with a hash of the whole run name.
MAX_FOLDER_NAME = 200


def folder_name(run_name: str) -> str:
    """An injective, portable folder name for ``run_name``.

    >>> folder_name("exp_1"), folder_name("exp/1"), folder_name("../escape")
    ('exp_1', 'exp%2F1', '%2E.%2Fescape')
    """
    encoded = urllib.parse.quote(str(run_name), safe="-_.")  # '%' itself is escaped: injective
    encoded = encoded.replace("~", "%7E")  # quote keeps '~'; some shells and tools expand it
    if encoded.startswith("."):  # no hidden folder, no "." or ".."
        encoded = "%2E" + encoded[1:]
    if not encoded:
        encoded = "%00run"  # the empty name; "%00" cannot come from quote()
    if len(encoded) > MAX_FOLDER_NAME:
        digest = hashlib.sha1(str(run_name).encode("utf-8")).hexdigest()[:16]
        encoded = encoded[: MAX_FOLDER_NAME - 17].rstrip("%0123456789ABCDEF") + "-" + digest
    return encoded


def default_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def check_resume(resume: str) -> str:
    if resume not in RESUME_POLICIES:
        raise expected("resume", f"one of {list(RESUME_POLICIES)} (as in wandb.init)", resume)
    return resume


def claim_store(run_dir: str, store_file: str, resume: str, derived: bool) -> tuple[str, bool]:
    """``(run_dir, resumed)``: the folder this worker writes ``store_file`` into, claimed for it.

    A derived name that is taken moves on to ``<run_dir>-2``, ``-3``, ...; a chosen one follows
    ``resume``. The store file is created empty here (its writer opens it later, on the
    dispatcher's thread), so the claim is atomic.
    """
    base = run_dir
    for attempt in range(1, 10_000):
        candidate = base if attempt == 1 else f"{base}-{attempt}"
        path = os.path.join(candidate, store_file)
        os.makedirs(candidate, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if derived and resume == "never":
                continue
            if resume == "never":
                raise FileExistsError(
                    f"The run folder {candidate!r} already holds a tensorlens run ({store_file}); pass resume='allow' "
                    "(or 'must') to continue it, or choose another run_name / out_dir for a new run"
                ) from None
            return candidate, True
        os.close(fd)
        if resume == "must":
            os.remove(path)
            raise FileNotFoundError(
                f"resume='must' but {candidate!r} holds no tensorlens run ({store_file}); pass resume='allow' to start one"
            )
        return candidate, False
    raise RuntimeError(f"no free run folder next to {base!r}")


def locate(
    out_dir: Any,
    run_name: str | None,
    tracker_run_name: str | None,
    resume: str,
    store_file: str,
    rank: int = 0,
    own_store: bool = True,
    share: Callable[[str, str], tuple[str, str]] | None = None,
    runs_dir: str | None = None,
) -> tuple[str, str, bool]:
    """``(run name, run folder, resumed)`` of a new recorder. Rank 0 (or the only process) claims
    the folder; ``share`` (a broadcast under ``torch.distributed``) gives every rank rank 0's, and a
    rank with a store of its own (``own_store``: ``include_workers="all"``) claims its file in it.
    The name is the one given, else the active tracker run's, else the time and a random id; without
    ``out_dir`` its folder is ``<runs_dir>/<name>`` (default ``./tensorlens_runs``)."""
    derived = run_name is None and out_dir is None
    name = run_name or tracker_run_name or default_run_name()
    wanted = os.path.abspath(os.fspath(out_dir)) if out_dir is not None else os.path.abspath(
        os.path.join(DEFAULT_RUNS_DIR if runs_dir is None else runs_dir, folder_name(name))
    )
    run_dir, resumed = wanted, False
    if rank == 0:
        run_dir, resumed = claim_store(wanted, store_file, resume, derived)
        if run_dir != wanted:  # a derived name that was taken: "<name>-2", ...
            name += run_dir[len(wanted):]
    if share is not None:
        name, run_dir = share(name, run_dir)
        if rank != 0 and own_store:
            run_dir, resumed = claim_store(run_dir, store_file, "allow" if resume == "never" else resume, False)
    return name, run_dir, resumed


def release_empty(run_dir: str, store_file: str) -> None:
    """Undo the claim of a run that recorded nothing (its store file is still empty)."""
    path = os.path.join(run_dir, store_file)
    try:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            os.remove(path)
            os.rmdir(run_dir)  # only if empty
    except OSError:
        pass
