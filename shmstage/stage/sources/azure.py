"""az:// sources (Azure Blob Storage) through obstore, see docs/object-stores.md.

The S3 source's LIST and fetch (stage/sources/s3.py) with Azure's store, URL and error codes: the
Blob service's LIST, ranged GET, If-Match and ETags work as S3's.  The storage account,
credentials and endpoint come from AZURE_* (obstore's names), never the command line.
"""

from __future__ import annotations

import os
import re
from typing import Any

from shmstage.errors import AccessDenied, NoCredentials, NoSuchBucket, RefusedError, ShmstageError
from shmstage.stage.sources import s3, s3store

# The spellings obstore (and fsspec's adlfs) accept for a container: all recorded as az://.
SCHEMES = ("az", "azure", "abfs", "abfss", "adl")
EMULATOR_ACCOUNT = "devstoreaccount1"  # Azurite's well-known account (obstore's default there)
_CONTAINER = r"[a-z0-9][a-z0-9\-]{1,61}[a-z0-9]|\$root|\$web"
_DENIED = ("AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
           "AuthorizationResourceTypeMismatch", "AuthorizationServiceMismatch",
           "AuthorizationProtocolMismatch", "AuthorizationSourceIPMismatch",
           "InsufficientAccountPermissions", "InvalidAuthenticationInfo",
           "NoAuthenticationInformation", "AccountIsDisabled")  # fmt: skip


def parse(raw: str) -> s3store.S3Url:
    """``az://container[/prefix]`` (or azure://, abfs[s]://, adl://), the account from
    AZURE_STORAGE_ACCOUNT_NAME; ``container@account.host`` is refused (say it once, in the
    environment, so one dataset has one URL)."""
    rest = raw.split("://", 1)[1]
    container = rest.partition("/")[0]
    if "@" in container:
        name, _, host = container.partition("@")
        account = host.split(".", 1)[0]
        raise RefusedError(
            f"{raw} names the storage account in the URL: set AZURE_STORAGE_ACCOUNT_NAME="
            f"{account} and write az://{name}/PREFIX"
        )
    if not re.fullmatch(_CONTAINER, container):
        raise RefusedError(f"invalid container name in {raw}: write az://CONTAINER/PREFIX")
    return s3store.parse(f"az://{rest}", "az", _CONTAINER, "container")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes", "y")


def account() -> str | None:
    """The storage account obstore will use (Azurite's when AZURE_STORAGE_USE_EMULATOR)."""
    name = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    return name or (EMULATOR_ACCOUNT if _truthy("AZURE_STORAGE_USE_EMULATOR") else None)


def endpoint() -> str:
    """The account's blob endpoint as obstore computes it (no credentials in it)."""
    env, acct = os.environ, account()
    if _truthy("AZURE_STORAGE_USE_EMULATOR"):
        base = env.get("AZURITE_BLOB_STORAGE_URL") or "http://127.0.0.1:10000"
        return f"{base.rstrip('/')}/{acct}"
    if env.get("AZURE_STORAGE_ENDPOINT") or env.get("AZURE_ENDPOINT"):
        return env.get("AZURE_STORAGE_ENDPOINT") or env["AZURE_ENDPOINT"]
    if not acct:
        return "Azure"
    if _truthy("AZURE_USE_FABRIC_ENDPOINT"):
        return f"https://{acct}.blob.fabric.microsoft.com"
    return f"https://{acct}.blob.core.windows.net"


class AzureSource(s3.S3Source):
    """A prefix of an Azure Blob container as a listed source (change key: ETag + size)."""

    kind = "az"
    extra = "azure"
    parse = staticmethod(parse)
    credentials_hint = (
        "set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN "
        "(or a service principal: AZURE_CLIENT_ID, AZURE_CLIENT_SECRET, AZURE_TENANT_ID), or run "
        "where managed identity answers"
    )
    endpoint_hint = "AZURE_STORAGE_ENDPOINT (AZURITE_BLOB_STORAGE_URL for the emulator)"

    def endpoint_name(self) -> str:
        return endpoint()

    def open_store(self) -> Any:
        from obstore.store import AzureStore

        if account() is None:
            raise NoCredentials(
                f"no storage account for {self.location}: set AZURE_STORAGE_ACCOUNT_NAME "
                "(AZURE_STORAGE_USE_EMULATOR=true for Azurite)"
            )
        return AzureStore(
            self.where.bucket,
            client_options=s3store.client_options(self.endpoint),
            retry_config=s3store.RETRY,
        )

    def coded_error(self, msg: str, code: str, name: str, obj: str) -> ShmstageError | None:
        # Azurite answers a LIST in an unknown account ResourceNotFound; Azure fails its DNS.
        if code == "ContainerNotFound" or (code == "ResourceNotFound" and obj == self.location):
            return NoSuchBucket(
                f"no container {self.where.bucket!r} in account {account()!r} at {self.endpoint}: "
                "check the URL and AZURE_STORAGE_ACCOUNT_NAME"
            )
        if code in _DENIED or name in ("PermissionDeniedError", "UnauthenticatedError"):
            return AccessDenied(
                f"cannot read {obj}: access denied ({code or name}); check the account key or SAS "
                "token and the container's access"
            )
        low = msg.lower()
        if "access key" in low or "sas key" in low or "sas query" in low:
            return NoCredentials(
                f"cannot use the credentials for {self.location}: the account key or SAS token "
                "in the environment is malformed"
            )
        return None
