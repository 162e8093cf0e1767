"""gs:// sources (Google Cloud Storage) through obstore, see docs/object-stores.md.

The S3 source's LIST and fetch (stage/sources/s3.py) with GCS's store, URL and error codes: obstore
reads GCS through its XML API, whose LIST, ranged GET, If-Match and ETags work as S3's.
Credentials and the endpoint come from GOOGLE_* or the metadata server, never the command line.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shmstage.errors import AccessDenied, NoCredentials, NoSuchBucket, ShmstageError
from shmstage.stage.sources import s3, s3store

DEFAULT_ENDPOINT = "https://storage.googleapis.com"
_BUCKET = r"[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]"
# Where obstore finds a service account (a file, or the JSON itself).
_ACCOUNT_FILES = ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH", "SERVICE_ACCOUNT")
_DENIED = ("AccessDenied", "AuthenticationRequired", "InvalidSecurity", "MissingSecurityHeader",
           "UserProjectMissing", "UserProjectAccountProblem", "AccountProblem")  # fmt: skip


def parse(raw: str) -> s3store.S3Url:
    """``gs://bucket[/prefix]``, the prefix a "directory" as for s3://."""
    return s3store.parse(raw, "gs", _BUCKET)


def _service_account() -> dict[str, Any]:
    """The service account obstore will use, for its ``gcs_base_url`` only ({} if none or
    unreadable: obstore then says what is wrong with it)."""
    env = os.environ
    try:
        if env.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
            return json.loads(env["GOOGLE_SERVICE_ACCOUNT_KEY"])
        for name in _ACCOUNT_FILES:
            if env.get(name):
                with open(env[name]) as f:
                    return json.load(f)
    except (OSError, ValueError):
        pass
    return {}


def endpoint() -> str | None:
    """GOOGLE_BASE_URL, else the service account's ``gcs_base_url`` (an emulator), else None."""
    url = os.environ.get("GOOGLE_BASE_URL") or _service_account().get("gcs_base_url")
    return url if isinstance(url, str) and url else None


def _has_credentials() -> bool:
    env = os.environ
    adc = os.path.join(
        os.path.expanduser("~"), ".config/gcloud/application_default_credentials.json"
    )
    return bool(
        any(env.get(k) for k in _ACCOUNT_FILES)
        or env.get("GOOGLE_SERVICE_ACCOUNT_KEY")
        or env.get("GOOGLE_APPLICATION_CREDENTIALS")
        or env.get("GOOGLE_BEARER_TOKEN")
        or env.get("GOOGLE_SKIP_SIGNATURE", "").lower() in ("true", "1")
        or os.path.isfile(adc)
        or env.get("NO_GCE_CHECK", "").lower() not in ("true", "1")  # the metadata server
    )


class GCSSource(s3.S3Source):
    """A prefix of a GCS bucket as a listed source (change key: ETag + size)."""

    kind = "gs"
    extra = "gcs"
    parse = staticmethod(parse)
    credentials_hint = (
        "set GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT (a service-account JSON "
        "file), or run where the metadata server answers"
    )
    endpoint_hint = "GOOGLE_BASE_URL (or the service account's gcs_base_url)"

    def endpoint_name(self) -> str:
        return endpoint() or DEFAULT_ENDPOINT

    def open_store(self) -> Any:
        from obstore.store import GCSStore

        if not _has_credentials():
            raise NoCredentials(
                f"no credentials for {self.location}: {self.credentials_hint} (NO_GCE_CHECK "
                "is set: the metadata server is not asked)"
            )
        return GCSStore(
            self.where.bucket,
            client_options=s3store.client_options(self.endpoint),
            retry_config=s3store.RETRY,
        )

    def coded_error(self, msg: str, code: str, name: str, obj: str) -> ShmstageError | None:
        # fake-gcs-server answers a LIST of a missing bucket 500 "no bucket named X"; GCS 404.
        if code == "NoSuchBucket" or f"no bucket named {self.where.bucket}<" in msg:
            return NoSuchBucket(
                f"no bucket {self.where.bucket!r} at {self.endpoint}: check the URL and "
                f"{self.endpoint_hint}"
            )
        if code in _DENIED or name in ("PermissionDeniedError", "UnauthenticatedError"):
            return AccessDenied(
                f"cannot read {obj}: access denied ({code or name}); check the credentials and "
                "the bucket's IAM policy"
            )
        if "service account" in msg.lower() or "application default credentials" in msg.lower():
            first = msg.splitlines()[0][:300] if msg else name
            return NoCredentials(f"cannot use the credentials for {self.location}: {first}")
        return None
