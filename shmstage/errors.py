"""The one exception root of the library.

Every expected failure (bad input, a refused operation, a failed copy) is a
``ShmstageError``.  The CLI prints ``Error: <message>`` on stderr and exits
with ``exit_code``; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ShmstageError(Exception):
    """An expected failure with a one-line message that says what to do."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class RefusedError(ShmstageError):
    """A precondition does not hold; nothing was changed (exit 2)."""

    exit_code = 2


class PermissionDenied(ShmstageError):
    """Not root / no CAP_SYS_ADMIN, or a path owned by someone else."""

    exit_code = 1


class CapacityError(RefusedError):
    """The data does not fit where it should go, reserve included."""


class VerifyError(ShmstageError):
    """A staged copy differs from its manifest or source (exit 3)."""

    exit_code = 3


class Interrupted(ShmstageError):
    """A signal (SIGTERM, SIGHUP, SIGINT) stopped the operation once it had cleaned up.

    ``exit_code`` is the shell's 128+N; the command line then dies of the signal itself
    (:class:`KilledBy`), so a calling shell loop stops as it would for any other command."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class KilledBy(SystemExit):
    """Raised to end the command line because of signal ``signal``: ``shmstage.cli.main``
    dies of it (bash ends a ``for`` loop on ^C only when its command died of SIGINT; an
    exit status of 130 means "handled", and the loop goes on).  A ``SystemExit`` with
    code 128+N, so a caller that cannot die (Click's test runner) still sees that number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal = signum


class ShmstageWarning(UserWarning):
    """Works, but not as it should (e.g. a job reads the unstaged source)."""


class SourceError(ShmstageError):
    """An object-store source failed; nothing was published.  Each kind has its own exit
    code (docs/s3.md "Exit codes") so scripts can tell a typo from a dead server."""

    exit_code = 1


class NoSuchBucket(SourceError):
    exit_code = 10


class EmptySource(SourceError):
    """A prefix with no objects: S3 answers an empty list, not an error."""

    exit_code = 11


class AccessDenied(SourceError):
    """403: the policy denies it, or the signature does not match (wrong secret)."""

    exit_code = 12


class UnknownAccessKey(SourceError):
    exit_code = 13


class NoCredentials(SourceError):
    exit_code = 14


class EndpointUnreachable(SourceError):
    """No answer from the endpoint before the first byte (wrong URL, server down)."""

    exit_code = 15


class SourceLost(SourceError):
    """The endpoint stopped answering mid-stage (after retries)."""

    exit_code = 16


class SourceChanged(SourceError):
    """An object changed between LIST and GET (its ETag moved)."""

    exit_code = 17
