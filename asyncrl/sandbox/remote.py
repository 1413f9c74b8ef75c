"""A client for a remote code sandbox speaking the SandboxFusion HTTP API (``sandbox.isolation:
remote``), the executor verl uses for code rewards on clusters.

One run is ``POST <url>/run_code`` with the JSON body ``{"code", "language": "python",
"run_timeout", "compile_timeout", "memory_limit_MB", "stdin", "files", "fetch_files"}``; the reply
is ``{"status": "Success" | "Failed" | "SandboxError", "message", "run_result": {"status":
"Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout", "stderr", "execution_time"}}``
(SandboxFusion's ``RunCodeRequest`` / ``RunCodeResponse``).

Promises: every request has a timeout (the run's own limit plus ``request_timeout_s``); connection
errors, timeouts and HTTP 5xx are retried ``max_retries`` times with exponential backoff; at most
``max_concurrency`` requests are in flight from one process (per URL); replies over
``max_response_bytes`` are refused. Failures raise ``RemoteSandboxError`` with a one-line reason.
Only the standard library is used.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_BACKOFF_S = 8.0


class RemoteSandboxConfig(BaseModel):
    """Where the remote sandbox lives and how hard to try (``sandbox.remote``)."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(
        None,
        description=(
            "SandboxFusion server, e.g. http://sandbox:8080 (requests go to <url>/run_code). Required "
            "with sandbox.isolation: remote."
        ),
    )
    request_timeout_s: float = Field(
        10.0, gt=0, description=("Seconds one request may take on top of the run's own timeout_s.")
    )
    max_retries: int = Field(2, ge=0, description="Retries after a connection error, a timeout or an HTTP 5xx.")
    backoff_s: float = Field(0.5, ge=0, description="Delay before the first retry; doubled each retry (max 8 s).")
    max_concurrency: int = Field(8, ge=1, description="Requests in flight at once from one process.")
    max_response_bytes: int = Field(1 << 20, ge=1024, description="Largest HTTP reply accepted.")

    @field_validator("url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {url!r}")
        return url


@dataclass(frozen=True)
class RemoteRun:
    """The ``run_result`` of one remote run."""

    status: str  # Finished, TimeLimitExceeded or Error
    return_code: int | None
    stdout: str
    stderr: str


class RemoteSandboxError(Exception):
    """A remote run that gave no result; ``str(e)`` is the one-line reason."""

    def __init__(self, reason: str, retry: bool = False):
        super().__init__(reason)
        self.retry = retry


_LIMITS: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_LIMITS_LOCK = threading.Lock()


def _in_flight_limit(cfg: RemoteSandboxConfig) -> threading.BoundedSemaphore:
    key = (cfg.url or "", cfg.max_concurrency)
    with _LIMITS_LOCK:
        return _LIMITS.setdefault(key, threading.BoundedSemaphore(cfg.max_concurrency))


def run_code(cfg: RemoteSandboxConfig, code: str, run_timeout_s: float, memory_mb: int) -> RemoteRun:
    """Run ``code`` on the remote sandbox once; retries as promised in the module docstring."""
    if not cfg.url:
        raise RemoteSandboxError("sandbox.remote.url is not set")
    body = json.dumps(
        {
            "code": code,
            "language": "python",
            "run_timeout": run_timeout_s,
            "compile_timeout": run_timeout_s,
            "memory_limit_MB": memory_mb,
            "stdin": "",
            "files": {},
            "fetch_files": [],
        }
    ).encode()
    url = cfg.url.rstrip("/") + "/run_code"
    timeout = run_timeout_s + cfg.request_timeout_s
    for attempt in range(cfg.max_retries + 1):
        try:
            with _in_flight_limit(cfg):
                return _parse(_post(url, body, timeout, cfg.max_response_bytes))
        except RemoteSandboxError as e:
            if not e.retry or attempt == cfg.max_retries:
                if e.retry:
                    raise RemoteSandboxError(f"{e} (after {attempt + 1} attempts)") from None
                raise
            time.sleep(min(cfg.backoff_s * 2**attempt, MAX_BACKOFF_S))
    raise AssertionError("unreachable")  # the loop returns or raises


def _post(url: str, body: bytes, timeout: float, max_bytes: int) -> bytes:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise RemoteSandboxError(f"remote sandbox HTTP {e.code} from {url}", retry=e.code >= 500) from None
    except TimeoutError:
        raise RemoteSandboxError(f"remote sandbox gave no answer within {timeout:g} s ({url})", retry=True) from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        if isinstance(why, TimeoutError):
            raise RemoteSandboxError(
                f"remote sandbox gave no answer within {timeout:g} s ({url})", retry=True
            ) from None
        raise RemoteSandboxError(f"remote sandbox unreachable at {url}: {why}", retry=True) from None
    if len(raw) > max_bytes:
        raise RemoteSandboxError(f"remote sandbox reply larger than {max_bytes} bytes")
    return raw


def _parse(raw: bytes) -> RemoteRun:
    """The ``run_result`` of a SandboxFusion reply, or why the reply is not one."""
    try:
        reply = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RemoteSandboxError(f"remote sandbox reply is not JSON: {raw[:120]!r}") from None
    if not isinstance(reply, dict) or reply.get("status") not in ("Success", "Failed", "SandboxError"):
        raise RemoteSandboxError(f"remote sandbox reply is not a SandboxFusion run_code response: {raw[:120]!r}")
    if reply["status"] == "SandboxError":
        raise RemoteSandboxError(f"remote sandbox error: {str(reply.get('message') or '')[:200]}")
    run = reply.get("run_result")
    if not isinstance(run, dict) or run.get("status") not in ("Finished", "TimeLimitExceeded", "Error"):
        raise RemoteSandboxError(f"remote sandbox reply has no run_result: {str(reply.get('message') or '')[:200]}")
    code = run.get("return_code")
    return RemoteRun(
        run["status"],
        code if isinstance(code, int) else None,
        str(run.get("stdout") or ""),
        str(run.get("stderr") or ""),
    )
