"""An object-store prefix opened through obstore (the optional ``shmstage[s3]`` extra): its
URL, credentials and endpoint from the environment (never the command line), the store with
bounded retries, and the one line each failure becomes (see docs/s3.md).
"""

from __future__ import annotations

import configparser
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shmstage.errors import (
    AccessDenied,
    EndpointUnreachable,
    NoCredentials,
    NoSuchBucket,
    RefusedError,
    ShmstageError,
    SourceChanged,
    SourceError,
    SourceLost,
    UnknownAccessKey,
)
from shmstage.identity import Caller, Share
from shmstage.stage.sources.base import Source
from shmstage.stage.sources.signedget import SignedGets

_CODE = re.compile(r"<Code>([^<]+)</Code>")
_CONNECT = ("error sending request", "connection refused", "tcp connect", "dns error",
            "connection reset", "connection closed", "broken pipe", "timed out",
            "operation timed out", "incomplete message", "unexpected eof")  # fmt: skip


@dataclass(frozen=True)
class S3Url:
    """An object-store prefix (gcs.py and azure.py use it with their schemes)."""

    bucket: str
    prefix: str  # "" or ending in "/"
    scheme: str = "s3"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix.rstrip('/')}".rstrip("/")

    def of(self, key: str) -> str:
        """The URL of one object (in messages)."""
        return f"{self.scheme}://{self.bucket}/{key}"


def parse(
    raw: str,
    scheme: str = "s3",
    pattern: str = r"[a-z0-9][a-z0-9.\-_]{1,254}",
    noun: str = "bucket",
) -> S3Url:
    """``s3://bucket[/prefix]``; the prefix is a "directory": ``train`` lists ``train/...``."""
    rest = raw.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    if not bucket or not re.fullmatch(pattern, bucket):
        raise RefusedError(f"invalid {noun} name in {raw}: write {scheme}://{noun.upper()}/PREFIX")
    prefix = prefix.strip("/")
    return S3Url(bucket, prefix + "/" if prefix else "", scheme)


def import_obstore(kind: str = "s3", extra: str = "s3") -> Any:
    try:
        import obstore  # the optional extra: only when an object store is read
    except ImportError:
        raise RefusedError(
            f"{kind}:// sources need the {extra} extra: pip install 'shmstage[{extra}]'"
        ) from None
    return obstore


# Every store's requests: bounded retries (docs/s3.md "How it reads"), short connect timeout.
RETRY = {"max_retries": 4, "retry_timeout": timedelta(seconds=30),
         "backoff": {"init_backoff": timedelta(milliseconds=100),
                     "max_backoff": timedelta(seconds=4), "base": 2}}  # fmt: skip


def client_options(endpoint: str | None) -> dict[str, Any]:
    return {"allow_http": bool(endpoint and endpoint.startswith("http://")),
            "connect_timeout": timedelta(seconds=5), "timeout": timedelta(seconds=120),
            "pool_max_idle_per_host": "64"}  # fmt: skip


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _profile_config() -> dict[str, str]:
    """Static keys and region of the ~/.aws profile (AWS_PROFILE, else default) when the
    environment has no keys: obstore reads only the environment and instance metadata."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return {}
    name = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    home = os.path.expanduser("~")
    out: dict[str, str] = {}
    creds = configparser.ConfigParser(interpolation=None)
    creds.read(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or f"{home}/.aws/credentials")
    if creds.has_section(name):
        sec = creds[name]
        for ours, theirs in (("access_key_id", "aws_access_key_id"),
                             ("secret_access_key", "aws_secret_access_key"),
                             ("session_token", "aws_session_token")):  # fmt: skip
            if sec.get(theirs):
                out[ours] = sec[theirs]
    conf = configparser.ConfigParser(interpolation=None)
    conf.read(os.environ.get("AWS_CONFIG_FILE") or f"{home}/.aws/config")
    section = name if name == "default" else f"profile {name}"
    no_region = not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))
    if no_region and conf.has_section(section) and conf[section].get("region"):
        out["region"] = conf[section]["region"]
    return out


def _has_credentials(config: dict[str, str]) -> bool:
    env = os.environ
    return bool(
        config.get("access_key_id")
        or env.get("AWS_ACCESS_KEY_ID")
        or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        or env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true"  # instance metadata
    )


class S3Bucket(Source):
    """A prefix of a bucket, opened: its store and the one line each failure becomes.

    gcs.py and azure.py override only the hooks (``parse``, ``endpoint_name``,
    ``open_store``, ``coded_error`` and the two hints); s3list.S3Prefix lists it and
    s3.S3Source fetches from it."""

    kind = "s3"
    extra = "s3"  # the pip extra that brings obstore
    parse = staticmethod(parse)
    credentials_hint = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    endpoint_hint = "AWS_ENDPOINT_URL"

    # The copy's owner and group, and its files' and directories' modes: this process's and
    # the listing's 0644/0755 unless a reader asked (readable_by).
    copy_ids: tuple[int, int] | None = None
    copy_modes: tuple[int, int] | None = None

    def __init__(self, location: str) -> None:
        self.obs = import_obstore(self.kind, self.extra)
        self.where = self.parse(location)
        self.location = self.where.url
        self.endpoint = self.endpoint_name()
        self.started = False  # a response came back: later connection errors are "lost"
        self.checksum = False  # fetch: compare single-part objects' bytes with their MD5 ETag
        self.ignores_range = False  # a ranged GET came back whole: no more ranged GETs
        self.signed: SignedGets | None = None  # fetch: big bodies over signed URLs (S3 only)
        try:
            self.store = self.open_store()
        except ShmstageError:
            raise
        except Exception as e:  # obstore refused the configuration (e.g. a malformed key)
            raise self.error(e) from None

    def readable_by(self, reader: Caller | None, share: Share | None) -> None:
        """The copy is the reader's (owner, and group unless ``share`` names one), readable by
        the reader alone: files 0600, directories 0700; by the share's group 0640/0750; by
        everyone 0644/0755.  None: as this process makes it (0644/0755, its own)."""
        if reader is None or reader.is_root:
            return
        share = share or Share()
        gid = share.gid if share.gid is not None else reader.gid
        self.copy_ids = (reader.uid, gid)
        if share.everyone:
            self.copy_modes = (0o644, 0o755)
        elif share.gid is not None:
            self.copy_modes = (0o640, 0o750)
        else:
            self.copy_modes = (0o600, 0o700)

    def owner(self, rel: str) -> os.stat_result | None:
        if self.copy_ids is None:
            return None
        uid, gid = self.copy_ids
        return os.stat_result((0, 0, 0, 0, uid, gid, 0, 0, 0, 0))  # what copy_owner reads

    def moded(self, entries: list[tuple]) -> list[tuple]:
        """The listing's entries with the modes :meth:`readable_by` chose."""
        if self.copy_modes is None:
            return entries
        fmode, dmode = self.copy_modes
        return [
            (e[0], e[1], e[2], e[3], dmode if e[1] == "d" else fmode if e[1] == "f" else e[4], e[5])
            for e in entries
        ]

    # --- the store (hooks) ---------------------------------------------------------

    def endpoint_name(self) -> str:
        """Where requests go, as messages name it (no credentials in it)."""
        return _endpoint() or "AWS"

    def open_store(self) -> Any:
        """The obstore store, configured from the environment only."""
        from obstore.store import S3Store

        config = _profile_config()
        if not _has_credentials(config):
            raise NoCredentials(
                f"no credentials for {self.location}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where instance metadata answers"
            )
        endpoint = _endpoint()
        if not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
            config.setdefault("region", "us-east-1")
        return S3Store(
            self.where.bucket,
            config=config,
            client_options=client_options(endpoint),
            retry_config=RETRY,
        )

    def coded_error(self, msg: str, code: str, name: str, obj: str) -> ShmstageError | None:
        """The store's own error codes (S3's ``<Code>``); None: the common mapping applies."""
        what = f"{self.location} ({self.endpoint})"
        if code == "NoSuchBucket":
            return NoSuchBucket(
                f"no bucket {self.where.bucket!r} at {self.endpoint}: check the URL, "
                "AWS_ENDPOINT_URL and AWS_REGION"
            )
        if code == "InvalidAccessKeyId":
            return UnknownAccessKey(
                f"{self.endpoint} does not know the access key in AWS_ACCESS_KEY_ID "
                f"(or the profile) reading {what}: check the credentials"
            )
        if code in ("SignatureDoesNotMatch", "AccessDenied", "AllAccessDisabled",
                    "InvalidToken", "ExpiredToken", "TokenRefreshRequired") or name in (
            "PermissionDeniedError", "UnauthenticatedError"):  # fmt: skip
            why = (
                "the secret key does not match"
                if code == "SignatureDoesNotMatch"
                else "access denied"
            )
            return AccessDenied(
                f"cannot read {obj}: {why} ({code or name}); check the credentials and the bucket policy"
            )
        return None

    # --- errors ------------------------------------------------------------------

    def error(self, e: BaseException, key: str | None = None) -> ShmstageError:
        """One line for an obstore failure (the store's code is in the message, see docs/s3.md)."""
        msg = str(e)
        code = m.group(1) if (m := _CODE.search(msg)) else ""
        low = msg.lower()
        obj = self.where.of(key) if key else self.location
        name = type(e).__name__
        coded = self.coded_error(msg, code, name, obj)
        if coded is not None:
            return coded
        if code == "PreconditionFailed" or name == "PreconditionError":
            return SourceChanged(
                f"{obj} changed while it was being staged; re-run when it is stable"
            )
        if name in ("NotFoundError", "FileNotFoundError") or code == "NoSuchKey":
            return SourceChanged(
                f"{obj} was deleted while it was being staged; re-run when the prefix is stable"
            )
        if name == "InvalidPathError" or "parsing path" in low or "empty path segment" in low:
            bad = m.group(1) if (m := re.search(r'Path "([^"]*)"', msg)) else "a key"
            return RefusedError(
                f"cannot stage {self.location}: key {bad!r} is not a safe file path (an empty, . or .. "
                "segment); rename it or stage a prefix without it"
            )
        if "credential" in low or "169.254.169.254" in low or "metadata" in low:
            return NoCredentials(f"no credentials for {self.location}: {self.credentials_hint}")
        if any(s in low for s in _CONNECT):
            if self.started:
                return SourceLost(
                    f"lost the connection to {self.endpoint} while staging {self.location} "
                    "(after retries); nothing was published: re-run when it answers"
                )
            return EndpointUnreachable(
                f"cannot reach {self.endpoint} for {self.location}: check {self.endpoint_hint} "
                "and the network"
            )
        status = re.search(r"status code: (\d{3}) ([A-Za-z ]+)", msg)
        if status:
            tries = (
                m.group(0) if (m := re.search(r"after \d+ retries", msg)) else "without retrying"
            )
            return SourceError(
                f"{self.endpoint} answered {status.group(1)} {status.group(2).strip()}"
                f"{f' ({code})' if code else ''} for {obj}, {tries}; nothing was published: re-run later"
            )
        first = msg.splitlines()[0] if msg else name
        first = re.sub(r"<\?xml.*|<Error>.*", "", first)[:300]
        return SourceError(f"cannot read {obj}: {first}")
