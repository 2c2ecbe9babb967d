"""The error answers each API route documents in the OpenAPI schema, declared once here.

Every status a route can really give is listed (schemathesis checks the server against
the schema with all its checks, tests/server/test_openapi_fuzz.py): the route's own
(404, 409, 422), the body checks and caps of server/http/middleware.py (400, 403, 408, 413,
415, 503), the token check (401, on every route but /health) and database faults
(server/faults.py: 503, and 507 for a write on a full disk). Each has the body
`ErrorPublic`.
"""

from __future__ import annotations

from typing import Any

from ampwatch.server.schemas.common import ErrorPublic

DESCRIPTIONS = {
    400: "the body is not valid gzip",
    401: "AMPWATCH_TOKEN is set and the request did not carry it",
    403: "a write from another site (its Origin), or authorised by the login cookie alone",
    404: "no such run, layer, notification or alert target",
    408: "the body did not arrive within AMPWATCH_BODY_TIMEOUT_S (a bundle's upload: "
         "AMPWATCH_BUNDLE_TIMEOUT_S)",
    409: "the request contradicts stored state",
    413: "the body is over AMPWATCH_MAX_BODY_BYTES (after gzip decompression too), or the "
         "run holds the most notes or bundles a run may",
    415: "the body is not application/json, or its Content-Encoding is not gzip",
    422: "invalid parameters or body: `detail` lists the fields (at most 10), or says why",
    503: "behind (no request slot freed within AMPWATCH_SLOT_WAIT_S, the body bytes in "
         "flight, every database connection busy, or more than AMPWATCH_MAX_PENDING_BATCHES "
         "batches awaiting analysis; Retry-After) or the database is unreachable, locked "
         "or gone",
    507: "the database's disk is full: nothing was stored",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait, when the server is busy",
                               "schema": {"type": "integer"}}}

ResponsesDoc = dict[int | str, dict[str, Any]]


def errors(*statuses: int) -> ResponsesDoc:
    """OpenAPI `responses` entries for these error statuses."""
    return {status: {"model": ErrorPublic, "description": DESCRIPTIONS[status],
                     **({"headers": RETRY_AFTER} if status == 503 else {})}
            for status in statuses}


# a read: invalid parameters, busy, the database down
READ = errors(422, 503)
# a write also passes the body checks and the Origin check, and can find the disk full
WRITE = errors(400, 403, 408, 413, 415, 422, 503, 507)
# routes under /api/v1 but /health: the token check
PROTECTED = errors(401)
NOT_FOUND = errors(404)
CONFLICT = errors(409)
