"""Where a run's files live: a local directory, or a directory in object storage named by a ``gs://BUCKET/PATH`` URL.

:func:`run_path` turns a ``--workdir`` (or ``init_from.workdir``) into the path every module of the trainer, eval,
generate and export reads and writes through: a ``pathlib.Path`` for a local path (a mounted bucket included) and an
``etils.epath.Path`` for a URL. Both have the pathlib methods lpt uses (``/``, ``exists``, ``is_dir``, ``iterdir``,
``read_text``, ``write_text``, ``open``, ``mkdir``, ``rename``); what object storage cannot do (append to a file,
``flock``, an atomic rename) is done another way where :func:`is_remote` says so:

* checkpoints: orbax and TensorStore write ``gs://`` natively; orbax marks a complete step with its
  ``commit_success.txt`` (a rename would be a copy), and :func:`lpt.train.checkpoint.steps` counts only those;
* the single-writer lock: a lease object written with TensorStore's conditional writes (:data:`kvstore_spec`;
  :mod:`lpt.train.workdir`);
* ``metrics.jsonl`` and the TensorBoard files: written locally and uploaded as whole objects
  (:class:`lpt.train.metrics.MetricsWriter`); ``config.json``, ``summary.json`` and ``loss.png``: whole objects.

Only ``gs://`` is allowed among the URL schemes: orbax writes checkpoints to Google Cloud Storage and to local paths,
to no other object store. ``etils.epath`` reaches ``gs://`` through ``gcsfs`` and orbax lists and deletes steps
with ``google-cloud-storage``, so both must be installed (``pip install 'lpt[gcs]'``); a ``gs://`` workdir without
them is a one-line ValueError that says so.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

_SCHEMES = ("gs",)  # the URL schemes a workdir may have (orbax's object store)
PACKAGES = {"gs": ("gcsfs", "google.cloud.storage")}  # imported by etils.epath and orbax for the scheme
_INSTALL = {"gs": "pip install 'lpt[gcs]' (gcsfs and google-cloud-storage)"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(workdir) -> str | None:
    """The URL scheme of ``workdir`` (``"gs"`` for ``gs://b/run``), None for a local path."""
    match = _URL.match(str(workdir))
    return match.group(1).lower() if match else None


def is_remote(path) -> bool:
    """True for an object-storage URL (or an ``etils.epath.Path`` of one), False for a local path."""
    return scheme(path) is not None


def missing_packages(url_scheme: str) -> list[str]:
    """The modules that the URL scheme needs and that cannot be imported."""
    missing = []
    for module in PACKAGES[url_scheme]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package (google.cloud) is missing
            found = False
        if not found:
            missing.append(module)
    return missing


def run_path(workdir, *, what: str = "--workdir") -> Any:
    """``workdir`` as a path: ``pathlib.Path(workdir)`` for a local path, ``etils.epath.Path`` for a ``gs://BUCKET/PATH``
    URL. ValueError (one line naming ``what`` and the value) for another scheme, a URL without a bucket or path, or a
    ``gs://`` URL when the packages it needs are not installed."""
    if isinstance(workdir, Path):
        return workdir
    url_scheme = scheme(workdir)
    if url_scheme is None:
        return Path(workdir)
    text = str(workdir)
    if url_scheme not in _SCHEMES:
        raise ValueError(
            f"{what} {text!r}: lpt cannot write runs to {url_scheme}:// URLs; give a local path or "
            f"gs://BUCKET/PATH (orbax's object store)"
        )
    bucket, _, rest = text[len(url_scheme) + 3 :].partition("/")
    if not bucket or not rest.strip("/"):
        raise ValueError(f"{what} {text!r} names no directory in a bucket; give {url_scheme}://BUCKET/PATH")
    missing = missing_packages(url_scheme)
    if missing:
        raise ValueError(
            f"{what} {text!r} needs {', '.join(missing)}, which cannot be imported: {_INSTALL[url_scheme]}"
        )
    from etils import epath

    return epath.Path(text.rstrip("/"))


def kvstore_spec(path) -> dict:
    """The TensorStore kvstore spec of the object-storage directory ``path`` (``gs://b/run`` -> the ``gcs`` driver on
    bucket ``b``, prefix ``run/``): lpt's conditional writes (the workdir lease) go through it."""
    url_scheme = scheme(path)
    if url_scheme != "gs":
        raise ValueError(f"{str(path)!r} is not a gs:// URL")
    bucket, _, rest = str(path)[len("gs://") :].partition("/")
    return {"driver": "gcs", "bucket": bucket, "path": rest.strip("/") + "/"}


def resolve(workdir, *, what: str = "--workdir") -> Any:
    """:func:`run_path`, made absolute with its symlinks resolved when it is local (a URL is absolute already)."""
    path = run_path(workdir, what=what)
    return path if is_remote(path) else path.resolve()


def overlap(path, other) -> str | None:
    """How the directory ``path`` overlaps ``other`` once both are resolved (symlinks followed; URLs compared by
    their text): ``"is"``, ``"is inside"`` or ``"contains"``; None when neither holds the other. A tool that writes
    ``path`` and reads ``other`` refuses any overlap: replacing ``path`` would delete what it reads."""
    a, b = (str(resolve(p)).rstrip("/") for p in (path, other))
    if a == b:
        return "is"
    if a.startswith(b + "/"):
        return "is inside"
    if b.startswith(a + "/"):
        return "contains"
    return None
