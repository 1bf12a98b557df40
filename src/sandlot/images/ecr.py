"""AWS ECR registry logins (E2B's ``fromImageRegistry`` type ``aws``): an access key turned
into a registry login by ECR's ``GetAuthorizationToken``, which the server calls (signed with
SigV4 by botocore, sent with httpx, with a timeout, no redirect followed). The call reaches
ECR's API only: the operator's ``SANDLOT_ECR_ENDPOINT``, else AWS's endpoint of a region whose
name is checked here (``us-east-1``); never a host a request names."""

from __future__ import annotations

import base64
import binascii
import logging
import re
from dataclasses import dataclass, field

import httpx

from sandlot.errors import ImageError, InvalidArgumentError

log = logging.getLogger(__name__)
REGION_RE = re.compile(r"[a-z]{2}(-[a-z]+)+-\d{1,2}")  # us-east-1, ap-southeast-2, us-gov-west-1
KEY_ID_RE = re.compile(r"[A-Za-z0-9]{1,128}")
MAX_SECRET = 256
TIMEOUT = 15.0  # s: the whole call
TARGET = "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"


@dataclass(frozen=True)
class Keys:
    """An AWS access key and the region of the registry it logs in to: for one build, kept
    in memory for its length, never saved or shown."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    region: str


def parse_keys(access_key_id: object, secret_access_key: object, region: object) -> Keys:
    """E2B's ``awsAccessKeyId``, ``awsSecretAccessKey`` and ``awsRegion``, checked
    (InvalidArgumentError)."""
    if not (isinstance(access_key_id, str) and KEY_ID_RE.fullmatch(access_key_id)):
        raise InvalidArgumentError("fromImageRegistry (aws): awsAccessKeyId must be an access "
                                   "key id (letters and digits, e.g. AKIA...)")
    if not (isinstance(secret_access_key, str) and 0 < len(secret_access_key) <= MAX_SECRET
            and secret_access_key.isprintable()):
        raise InvalidArgumentError("fromImageRegistry (aws): awsSecretAccessKey is required "
                                   f"(printable, at most {MAX_SECRET} characters)")
    if not (isinstance(region, str) and REGION_RE.fullmatch(region)):
        raise InvalidArgumentError(f"fromImageRegistry (aws): awsRegion {str(region)[:40]!r} "
                                   "is not an AWS region name (e.g. us-east-1)")
    return Keys(access_key_id, secret_access_key, region)


def endpoint(region: str, configured: str | None = None) -> str:
    """ECR's API for `region`: the operator's endpoint, else AWS's regional one."""
    if configured:
        return configured.rstrip("/")
    if not REGION_RE.fullmatch(region):
        raise InvalidArgumentError(f"not an AWS region name: {region[:40]!r}")
    return f"https://api.ecr.{region}.amazonaws.com" + (".cn" if region.startswith("cn-")
                                                        else "")


async def login(keys: Keys, configured: str | None = None,
                timeout: float = TIMEOUT) -> tuple[str, str]:
    """The registry login (user ``AWS``, a token valid 12 hours) ECR gives `keys`; an
    ImageError saying why when it gives none (keys refused, API unreachable)."""
    from botocore.auth import SigV4Auth  # noqa: PLC0415 - 0.1 s, for this call alone
    from botocore.awsrequest import AWSRequest  # noqa: PLC0415
    from botocore.credentials import Credentials  # noqa: PLC0415

    url = endpoint(keys.region, configured) + "/"
    where = f"ECR's API (region {keys.region})"
    body = b"{}"
    request = AWSRequest("POST", url, data=body, headers={
        "Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": TARGET})
    try:
        SigV4Auth(Credentials(keys.access_key_id, keys.secret_access_key), "ecr",
                  keys.region).add_auth(request)
        async with httpx.AsyncClient(timeout=timeout) as client:
            answer = await client.post(url, content=body, headers=dict(request.headers.items()))
    except (httpx.HTTPError, ValueError) as e:
        log.warning("ECR GetAuthorizationToken at %s: %s: %s", url, type(e).__name__, e)
        raise ImageError(f"{where} could not be reached ({type(e).__name__}): no registry "
                         "login for the build") from None
    if answer.status_code != 200:
        if 400 <= answer.status_code < 500:
            kind, message = _error(answer)
            raise ImageError(f"{where} refused the access key: {kind or answer.status_code}"
                             + (f": {message[:300]}" if message else ""))
        raise ImageError(f"{where} answered {answer.status_code}: no registry login for the "
                         "build")
    try:
        doc = answer.json()
    except ValueError:
        doc = None
    return _token(doc, where)


def _error(answer: httpx.Response) -> tuple[str, str]:
    """An AWS error's code and message: JSON (ECR's protocol, ``__type``, ``message``) or the
    XML of AWS's query protocol (``<Code>``, ``<Message>``)."""
    kind = answer.headers.get("x-amzn-errortype", "").partition(":")[0]
    try:
        doc = answer.json()
    except ValueError:
        code = re.search(r"<Code>([^<]{1,100})</Code>", answer.text)
        message = re.search(r"<Message>([^<]{1,300})</Message>", answer.text)
        return (kind or (code.group(1) if code else "")), message.group(1) if message else ""
    if not isinstance(doc, dict):
        return kind, ""
    kind = kind or str(doc.get("__type") or doc.get("code") or "").rpartition("#")[2]
    return kind, str(doc.get("message") or doc.get("Message") or "")


def _token(doc: object, where: str) -> tuple[str, str]:
    """The login in a GetAuthorizationToken answer: base64 of ``AWS:<password>``."""
    try:
        token = doc["authorizationData"][0]["authorizationToken"]  # type: ignore[index]
        user, colon, password = base64.b64decode(token, validate=True).decode().partition(":")
    except (KeyError, IndexError, TypeError, binascii.Error, UnicodeDecodeError):
        raise ImageError(f"{where} answered without an authorization token") from None
    if not (colon and user and password):
        raise ImageError(f"{where} answered a token that is not a login")
    return user, password


__all__ = ["Keys", "parse_keys", "endpoint", "login"]
