"""An object store opened with the caller's credentials, never the service's: while a
source is opened for a caller, this process's environment holds the caller's AWS_*,
GOOGLE_* and AZURE_* variables instead of its own, the node's metadata credentials are off,
and credential files are read with the caller's file-system ids.

obstore reads its configuration from the process environment when a store is built, so the
environment itself is swapped for that moment (a service's per-request child is the only
thread that builds a store then).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from shmstage.errors import RefusedError
from shmstage.identity import Caller, reading_as

PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
# What else obstore and the sources read as credentials or their location.
OTHER = frozenset(("SERVICE_ACCOUNT", "NO_GCE_CHECK", "HOME"))
# Read later by obstore's own threads (as root), or the node's identity: never the caller's.
REFUSED = frozenset(
    (
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AZURE_FEDERATED_TOKEN_FILE",
        "AZURE_MSI_ENDPOINT",
        "AZURE_IDENTITY_ENDPOINT",
        "AZURE_MSI_RESOURCE_ID",
        "AZURE_OBJECT_ID",
        "AZURE_USE_AZURE_CLI",
    )
)
# The node's own identity (instance metadata, the GCE metadata server) is never asked.
FORCED = {"AWS_EC2_METADATA_DISABLED": "true", "NO_GCE_CHECK": "true"}
# Azure's credentials; without one, obstore would ask the node's managed identity.
_AZURE_KEYS = (
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_USE_EMULATOR",
    "AZURE_SKIP_SIGNATURE",
)


def is_credential(name: str) -> bool:
    """A variable that says who an object store is read as (or where that is kept)."""
    return name.startswith(PREFIXES) or name in OTHER


def caller_env(
    base: Mapping[str, str], credentials: Mapping[str, str] | None, home: str
) -> dict[str, str]:
    """``base`` without any credential variable, plus the caller's (``credentials``: only
    the credential variables in it count), plus :data:`FORCED`.  RefusedError for a
    variable that would lend the node's identity or a file obstore reads later as root."""
    given = {k: v for k, v in (credentials or {}).items() if is_credential(k) and k != "HOME"}
    refused = sorted(k for k in given if k in REFUSED)
    if refused:
        raise RefusedError(
            f"{refused[0]} cannot be used through the node service (it names the node's "
            "identity, or a file read later as root); pass keys or a token in the "
            "environment, or stage with --no-service"
        )
    env = {k: v for k, v in base.items() if not is_credential(k)}
    env.update(given)
    env.update(FORCED)
    if not any(given.get(k) for k in _AZURE_KEYS):
        env["AZURE_SKIP_SIGNATURE"] = "true"  # anonymous at most, never the node's identity
    env["HOME"] = home
    return env


def home_of(reader: Caller | None) -> str:
    """Where the caller's ~/.aws and ~/.config/gcloud are (read as the caller)."""
    if reader is None:
        return "/nonexistent"
    try:
        return pwd.getpwuid(reader.uid).pw_dir or "/nonexistent"
    except KeyError:
        return "/nonexistent"


@contextmanager
def caller_environment(
    credentials: Mapping[str, str] | None, reader: Caller | None
) -> Iterator[None]:
    """For the block: the environment :func:`caller_env` makes, and this thread's file-system
    ids the reader's (a credential file named in it, a profile in the caller's home, is read
    as the caller or not at all).  The service's environment is back afterwards."""
    saved = dict(os.environ)
    env = caller_env(saved, credentials, home_of(reader))
    os.environ.clear()
    os.environ.update(env)
    try:
        with reading_as(reader):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
